"""kernel_ptx_ops' readings without a compile: PTX statements counted one by one (Triton's
inline asm puts several on a line), XLA's thunk sequence read for each launch, and how
many blocks an H100 SM holds."""

import kernel_ptx_ops

PTX = """
.visible .entry ragged_paged_attention_gpu_q16_kv128_s2_w4_p1_d(
	.param .u64 p0
)
.reqntid 128, 1, 1
{
	// begin inline asm
	mov.u32 %r40, 0x0; mov.u32 %r41, 0x0; ld.global.v4.b32 { %r40, %r41, %r42, %r43 }, [ %rd64 + 0 ];
	// end inline asm
	@%p1 ld.global.b32 { %r35 }, [ %rd59 + 0 ];
	@!%p2 st.shared.v4.b32 	[%rd89+32768], {%r83, %r84, %r85, %r86};
	mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r1}, {%r2}, {%f2};
$L__BB0_2:
	ret;
}
"""

THUNKS = """000: kCommandBuffer [source | sink]
    001: kCustomKernel [source       | next=002 (1)] loop_reduce_window_fusion grid: [1, 1, 1] threads: [64, 1, 1]  shared_memory: 0 bytes
    002: kCustomKernel [prev=001 (1) | next=003 (1)] ragged_paged_attention_gpu_q16_kv128_s2_w4_p1_d_m grid: [64, 8, 2] threads: [128, 1, 1]  shared_memory: 40960 bytes
    003: kCustomKernel [prev=002 (1) | sink        ] loop_convert_fusion grid: [2048, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
"""


def test_every_statement_of_a_line_is_counted():
    ops = kernel_ptx_ops.kernel_ops(PTX)
    assert ops["mov.u32"] == 2 and ops["ld.global.v4.b32"] == 1     # one inline-asm line
    assert ops["ld.global.b32"] == 1 and ops["st.shared.v4.b32"] == 1  # predicated
    assert ops["mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"] == 1
    assert ops["ret"] == 1 and not any(op.startswith("$") for op in ops)


SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;                        /* 0x00000a00ff017b82 */
        /*3920*/                   FFMA R96, R96, 0.12751743197441101074, R141.reuse ;   /* 0x3e */
        /*39c0*/                   MUFU.EX2 R104, R112 ;                         /* 0x0000 */
        /*3a00*/               @!P2 FMUL R3, R3, 0.25 ;                          /* 0x0000 */
        /*2900*/                   HGMMA.64x64x16.F32.BF16 R88, R132, gdesc[UR48], RZ, !UPT ;
        /*3b00*/              @UP0 UIADD3 UR4, UR4, 0x1, URZ ;                   /* 0x0000 */
                                                                                 /* 0x000fc8 */
"""


def test_sass_opcodes_are_counted_without_their_modifiers():
    ops = kernel_ptx_ops.sass_counts(SASS)
    assert ops == {"LDC": 1, "FFMA": 1, "MUFU": 1, "FMUL": 1, "HGMMA": 1, "UIADD3": 1}


def test_launches_are_read_from_the_thunk_sequence(tmp_path):
    path = tmp_path / "module_0001.jit_f.thunk_sequence_after_thunk_passes.txt"
    path.write_text(THUNKS)
    calls = kernel_ptx_ops.launches([str(path), str(tmp_path / "other.ptx")])
    assert [c["name"] for c in calls] == [
        "loop_reduce_window_fusion", "ragged_paged_attention_gpu_q16_kv128_s2_w4_p1_d_m",
        "loop_convert_fusion"]
    assert calls[1]["grid"] == [64, 8, 2] and calls[1]["threads"] == [128, 1, 1]
    assert calls[1]["shared"] == 40960


def test_blocks_an_h100_sm_holds():
    # registers: 161 a thread round up to 168 (256 a warp); 65,536 / (5,376 x 4) = 3
    assert kernel_ptx_ops.occupancy(128, 40960, 161) == 3
    assert kernel_ptx_ops.occupancy(128, 22528, 128) == 4
    # shared memory: 233,472 / (135,168 + 1,024) = 1
    assert kernel_ptx_ops.occupancy(128, 135168, 32) == 1
    # without ptxas only shared memory and threads bound it
    assert kernel_ptx_ops.occupancy(128, 0, None) == 16


def test_the_softmax_exponentials_are_one_ex2_each_in_an_h100_compile():
    """The kernel's softmax is exp2 of base-2 scores through one ``ex2.approx.ftz`` each:
    no libdevice expf (its range reduction rounds down with ``fma.rm.f32`` and saturates
    with ``cvt.sat.f32.f32``, ~10 instructions a score where the scores' other softmax
    work is ~6). A prefill-shaped call compiled for an H100 (XLA's dump needs its flags
    before JAX starts: a process of its own)."""
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(kernel_ptx_ops.__file__), "kernel_ptx_ops.py")
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1")
    run = subprocess.run(
        [sys.executable, script, "--prefill", "--kv-format", "bfloat16",
         "--base", "block_kv=64,num_warps=4,num_stages=2", "--variant", "mask_split=false",
         "--ops", "ex2,fma.rm,cvt.sat,wgmma.mma_async"],
        env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {line.split("|")[1].strip(" `"): line.split("|")[2:4]
            for line in run.stdout.splitlines() if line.startswith("| `")}
    assert "ex2.approx.ftz.f32" in rows, run.stdout
    assert not any(op.startswith(("fma.rm", "cvt.sat")) for op in rows), rows
    # one loop body (every block masked): an exponential per score of the 64 x 64 tile
    # over 128 threads, and the rescale factors of the two rows a thread's MMA fragment holds
    masked_only = int(rows["ex2.approx.ftz.f32"][1])
    assert masked_only == 64 * 64 // 128 + 2, rows
    assert any(op.startswith("wgmma.mma_async") for op in rows), rows   # Hopper's MMA
