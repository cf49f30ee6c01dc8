"""Which jitted function runs a batch, and the name its compiled program is saved and
shared under (``ExecutableCache`` keys programs by name and bucket).

The host picks a batch's sampling program (``core.step_features.features_of``) on a GPU,
where a conditional inside a program makes the launch wait for the device, and on the
CPU, where the conditionals' results are fresh copies of the [S, V] logits (the tiny
preset's 1,024-row decode step: 18 -> 8.4 ms). A TPU runs the program that decides with
conditionals on the device for every batch. A GPU also runs a decode call's K iterations
as a loop of known length (no early exit).
"""

from __future__ import annotations

from typing import Any, Callable

from jaxpage.core.batch_metadata import BatchMetadata
from jaxpage.core.step_features import StepFeatures, features_of
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

    def features(self, batch: BatchMetadata, device_decided: bool = False
                 ) -> StepFeatures | None:
        """The features of the program that runs ``batch`` (``device_decided``: the
        program that decides on the device, whatever the batch needs)."""
        return features_of(batch, self.host_decides_branches and not device_decided)

    @staticmethod
    def name(base: str, features: StepFeatures | None) -> str:
        """A single step's program name: ``base`` ("step", "step-masked", "verify-q4")
        and the features' suffix."""
        return base + (features.suffix if features is not None else "")

    def step(self, verify: bool, features: StepFeatures | None) -> Any:
        """The jitted single step (``verify``: the speculative verify step)."""
        step = self.steps.get((verify, features))
        if step is None:
            step = self.steps[verify, features] = make_step(
                self._graphdef, jit=self._jit, verify=verify, features=features)
        return step

    def decode(self, num_steps: int, features: StepFeatures | None) -> tuple[str, Any]:
        """(name, jitted loop) of the multi-step decode call: the name tells its
        iterations, its features and whether its length is fixed (each its own program)."""
        key = (num_steps, features, self.fixed_decode_length)
        loop = self.decode_loops.get(key)
        if loop is None:
            loop = self.decode_loops[key] = make_decode_loop(
                self._graphdef, num_steps, self._block_size, jit=self._jit,
                features=features, fixed_length=self.fixed_decode_length)
        name = self.name(f"decode{num_steps}", features)
        return name + ("+fixed" if self.fixed_decode_length else ""), loop
