"""Which jitted function runs a batch, and the key its compiled program is saved and
shared under (``core.batch.program_set.ProgramKey``, which ``ExecutableCache`` keys programs by).

The host picks a batch's sampling program (``core.batch.step_features.features_of``) on a GPU,
where a conditional inside a program makes the launch wait for the device, and on the
CPU, where the conditionals' results are fresh copies of the [S, V] logits
(``docs/benchmarks/design_measurements.md``). A TPU runs the program that decides with
conditionals on the device for every batch. On a GPU that program (the one for batches
needing more than greedy or plain sampling) has no conditional either: traced there, it
does all the optional sampling work for every row (``runtime.step.branch_free``). A GPU
also runs a decode call's K iterations as a loop of known length (no early exit).
"""

from __future__ import annotations

from typing import Any, Callable

from jaxpage.core.batch.batch_metadata import BatchMetadata
from jaxpage.core.batch.program_set import ProgramKey
from jaxpage.core.batch.step_features import StepFeatures, features_of
from jaxpage.runtime.compiler_options import decode_jit
from jaxpage.runtime.decode_loop import make_decode_loop
from jaxpage.runtime.step import make_step
from pallas_kernels._backend import branches_wait_for_device


class StepPrograms:
    """The single, verify and multi-step decode functions of one model, each made once
    per sampling-feature choice (None: decided on the device)."""

    def __init__(self, graphdef: Any, block_size: int, jit: Callable, platform: str) -> None:
        self.host_decides_branches = platform == "cpu" or branches_wait_for_device(platform)
        self.fixed_decode_length = branches_wait_for_device(platform)
        # On accelerators the device-decided single step always takes a grammar mask (all
        # tokens allowed when no row has a grammar), so a structured-output batch runs a
        # program of the engine's set instead of one of its own; the CPU keeps a separate
        # "step-masked" program (a mask pass over [S, V] costs a CPU step more).
        self.mask_in_device_step = platform != "cpu"
        self.steps: dict[tuple[bool, StepFeatures | None], Any] = {}
        self.decode_loops: dict[tuple[int, StepFeatures | None, bool], Any] = {}
        self._graphdef, self._block_size, self._jit = graphdef, block_size, jit
        self._decode_jit = decode_jit(jit, platform)   # XLA options of decode programs

    def features(self, batch: BatchMetadata) -> StepFeatures | None:
        """The features of the program that runs ``batch`` (None: the program that decides
        on the device, which runs any batch)."""
        return features_of(batch, self.host_decides_branches)

    def key(self, kind: str, bucket: tuple[int, ...], features: StepFeatures | None,
            steps: int = 1, draft_rows: int = 0) -> ProgramKey:
        """The key of the ``kind`` program ("step", "step-masked", "verify", "decode") of
        ``bucket`` with ``features`` on this platform (a decode loop's length fixed or not;
        ``steps``: a decode call's iterations; ``draft_rows``: a verify step's Q)."""
        return ProgramKey.of(kind, bucket, features, host_decides=self.host_decides_branches,
                             steps=steps, draft_rows=draft_rows,
                             fixed_length=self.fixed_decode_length)

    def takes_mask(self, key: ProgramKey) -> bool:
        """The program takes a grammar mask (``make_step``'s ``token_mask``): the CPU's
        "step-masked", and on accelerators every device-decided single step."""
        return key.kind == "step-masked" or (key.kind == "step" and key.features is None
                                             and self.mask_in_device_step)

    def jitted(self, key: ProgramKey) -> Any:
        """The jitted function of ``key``'s program (any bucket): the single step ("step"
        and "step-masked" share it: the mask is an argument), the verify step, or the
        decode loop of ``key.steps`` iterations; each made once."""
        if key.kind == "decode":
            loop_key = (key.steps, key.features, key.fixed_length)
            loop = self.decode_loops.get(loop_key)
            if loop is None:
                loop = self.decode_loops[loop_key] = make_decode_loop(
                    self._graphdef, key.steps, self._block_size, jit=self._decode_jit,
                    features=key.features, fixed_length=key.fixed_length)
            return loop
        step_key = (key.kind == "verify", key.features)
        step = self.steps.get(step_key)
        if step is None:
            step = self.steps[step_key] = make_step(self._graphdef, jit=self._jit,
                                                    verify=step_key[0], features=key.features)
        return step
