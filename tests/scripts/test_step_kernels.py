"""step_kernels' reading of compiled HLO: the loop body's kernels (tuple-shaped custom
calls included), and one layer cut at the attention calls."""

import pytest

import step_kernels

HLO = """HloModule jit_step

%fused_add (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %a = f32[4]{0} add(%p, %p)
}

%body (arg: (s32[], f32[4])) -> (s32[], f32[4]) {
  %arg = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%arg), index=1
  %pallas_call.1 = (f32[2,4]{1,0}, f32[2]{0}) custom-call(%x), custom_call_target="__gpu$xla.gpu.triton"
  %gte = f32[2,4]{1,0} get-tuple-element(%pallas_call.1), index=0
  %loop_add_fusion = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_add
  %gemm_fusion_dot.1 = f32[4]{0} fusion(%loop_add_fusion), kind=kCustom, calls=%fused_add
  %pallas_call.2 = (f32[2,4]{1,0}, f32[2]{0}) custom-call(%x), custom_call_target="__gpu$xla.gpu.triton"
  %copy.1 = f32[4]{0} copy(%x)
  %pallas_call.3 = (f32[2,4]{1,0}, f32[2]{0}) custom-call(%x), custom_call_target="__gpu$xla.gpu.triton"
  ROOT %t = (s32[], f32[4]{0}) tuple(%x, %copy.1)
}

%cond (arg: (s32[], f32[4])) -> pred[] {
  %arg = (s32[], f32[4]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  ROOT %w = (s32[], f32[4]{0}) while(%p), condition=%cond, body=%body
}
"""


def test_the_loop_body_kernels_and_one_layer_are_found():
    comps = step_kernels.computations(HLO)
    assert set(comps) == {"fused_add", "body", "cond", "main"}
    assert step_kernels.loop_bodies(HLO) == ["body"]
    kernels = step_kernels.launches(comps["body"])
    assert [op for _, op in kernels] == ["custom-call", "fusion", "fusion", "custom-call",
                                         "copy", "custom-call"]
    layer = step_kernels.one_layer(kernels)       # from the second attention call
    assert [name for name, _ in layer] == ["pallas_call.2", "copy.1"]


@pytest.mark.slow  # ~60 s: a 4-layer Llama-3-8B decode program compiled for an H100
def test_an_h100_decode_step_is_counted(capsys):
    assert step_kernels.main(["--layers", "4"]) == 0
    out = capsys.readouterr().out
    assert "kernels a step" in out and "one layer's kernels" in out
