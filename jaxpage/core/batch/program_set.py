"""The engine's program set: every device program it can run, named by ``ProgramKey``,
split into the *ready set* compiled before the engine takes requests and the rest,
compiled afterwards on a background thread, largest first.

The ready set holds, for each kind of call, its largest bucket in the program that
decides sampling on the device (which any batch can run): the largest mixed step, the
largest multi-step decode call (when ``num_scheduler_steps > 1``), the largest verify
step (with speculation), the largest block move, and the penalty fill. Every batch fits
one of them padded (``pad_batch``), so once they exist no request waits for a compile:
a batch whose own program is not built yet runs in the smallest built one that holds it.

``LLM(warmup=...)`` and ``jaxpage plan --buckets`` enumerate the same keys, so the plan
compiles exactly what an engine compiles. Host only: no JAX here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from jaxpage.core.batch.batch_metadata import BatchMetadata
from jaxpage.core.batch.batch_shapes import BatchShapes
from jaxpage.core.batch.step_features import BASE_FEATURES, StepFeatures

# Kinds of program, in the order the ready set lists them.
KINDS = ("step", "step-masked", "decode", "verify", "move_blocks", "penalty_fill")


@dataclass(frozen=True)
class ProgramKey:
    """One compiled program: what it runs, its bucket, and which variant. It names the
    program everywhere: the runner's dispatch, the executable cache (memory and disk), the
    fallback, warm-up and the planner.

    ``kind``: "step", "step-masked" (the CPU's grammar-masked step), "verify", "decode",
    "move_blocks", "penalty_fill" (the runtime's block helpers add their own, e.g.
    "gather_blocks"). ``bucket``: (T, S, M) for the model's kinds (``MODEL_KINDS``); (P,)
    blocks for "move_blocks"; (W,) tokens for "penalty_fill".

    The variant facts: ``steps``, a "decode" call's iterations (1 for every other kind);
    ``device_decided``, where the host picks each batch's sampling program
    (``StepPrograms.host_decides_branches``), the program that decides on the device
    instead, which runs any batch (False for the host-decided one, and for every program
    where the device always decides: one variant only); ``features``, the sampling work
    a host-decided program does (``core.batch.step_features``; None: decided on the device);
    ``draft_rows``, a "verify" step's Q, the rows of draft distributions it takes (0 for
    every other kind); ``fixed_length``, a "decode" loop that runs all its iterations (a
    GPU's; False for every other kind).

    Invariants (kept by ``of``, which every engine-made key comes from): ``device_decided``
    implies ``features is None``; the kind-specific facts hold their neutral values
    (steps 1, draft_rows 0, fixed_length False) on the kinds they do not describe.
    ``name`` (and ``file_name``) tell every fact apart; ``label`` is for people.
    """

    kind: str
    bucket: tuple[int, ...]
    steps: int = 1
    device_decided: bool = False
    features: StepFeatures | None = None
    draft_rows: int = 0
    fixed_length: bool = False

    @classmethod
    def of(cls, kind: str, bucket: tuple[int, ...], features: StepFeatures | None, *,
           host_decides: bool, steps: int = 1, draft_rows: int = 0,
           fixed_length: bool = False) -> "ProgramKey":
        """The key of a model program (``MODEL_KINDS``) with sampling ``features`` (None:
        decided on the device), where the host decides (``host_decides``) or not; the
        facts a kind does not have are dropped (``steps`` and ``fixed_length`` belong to
        "decode", ``draft_rows`` to "verify")."""
        decode = kind == "decode"
        return cls(kind, tuple(bucket), steps if decode else 1,
                   features is None and host_decides, features,
                   draft_rows if kind == "verify" else 0, fixed_length and decode)

    @property
    def name(self) -> str:
        """The program's name, every variant fact in it: e.g. "step+sampled",
        "step-masked", "verify-q4+sampled", "decode8+sampled+fixed", "move_blocks"."""
        base = {"decode": f"decode{self.steps}",
                "verify": f"verify-q{self.draft_rows}"}.get(self.kind, self.kind)
        suffix = self.features.suffix if self.features is not None else ""
        return base + suffix + ("+fixed" if self.fixed_length else "")

    @property
    def file_name(self) -> str:
        """The file its compiled executable is saved in: the name and the bucket."""
        return f"{self.name}-{'x'.join(str(b) for b in self.bucket)}.bin"

    @property
    def label(self) -> str:
        """For people (the planner's report): kind, iterations, the device-decided
        variant and the bucket, e.g. "decode8(device-decided)[256, 256, 512]"."""
        name = f"decode{self.steps}" if self.kind == "decode" else self.kind
        return f"{name}{'(device-decided)' if self.device_decided else ''}{list(self.bucket)}"

    def holds(self, other: "ProgramKey") -> bool:
        """This program can run ``other``'s batches padded: the same kind and kind facts
        (iterations, draft rows, fixed length), every bucket dimension at least as large,
        and a variant that runs them (the device-decided program runs any batch; a
        host-decided one the batches of its own features)."""
        return (self.kind == other.kind and self.steps == other.steps
                and self.draft_rows == other.draft_rows
                and self.fixed_length == other.fixed_length
                and (self.device_decided
                     or (not other.device_decided and self.features == other.features))
                and len(self.bucket) == len(other.bucket)
                and all(a >= b for a, b in zip(self.bucket, other.bucket)))


# The kinds of program that run the model on a batch of bucket (T, S, M).
MODEL_KINDS = ("step", "step-masked", "decode", "verify")


@dataclass(frozen=True)
class ProgramSet:
    """The ready set and the rest (largest first), disjoint."""

    ready: tuple[ProgramKey, ...]
    background: tuple[ProgramKey, ...]

    @property
    def all(self) -> tuple[ProgramKey, ...]:
        return self.ready + self.background


def program_set(shapes: BatchShapes, *, num_steps: int, host_decides: bool,
                move_sizes: Iterable[int], penalty_width: int,
                verify_shapes: list[tuple[int, int, int]] | None = None,
                masked_steps: bool = False, fixed_decode: bool = False,
                draft_rows: int = 1) -> ProgramSet:
    """Every program of an engine with these ladders (``shapes``), multi-step decode calls
    of ``num_steps`` iterations (none when 1; ``fixed_decode``: loops of known length, a
    GPU's), sampling decided by the host (``host_decides``: two variants of each step and
    decode program, the host-decided one with ``BASE_FEATURES``), block moves of
    ``move_sizes``, speculative verify steps of ``verify_shapes`` (None: no speculation)
    taking ``draft_rows`` draft distributions and, with ``masked_steps``, grammar-masked
    steps of their own (the CPU's; on accelerators the device-decided step takes the
    mask: ``StepPrograms``)."""
    variants = (False, True) if host_decides else (False,)

    def key(kind: str, shape: tuple[int, ...], device: bool) -> ProgramKey:
        features = BASE_FEATURES if host_decides and not device else None
        return ProgramKey.of(kind, shape, features, host_decides=host_decides,
                             steps=num_steps, draft_rows=draft_rows, fixed_length=fixed_decode)

    step_kinds = ("step", "step-masked") if masked_steps else ("step",)
    models = [key(kind, shape, device) for kind in step_kinds
              for shape in shapes.step_shapes() for device in variants]
    if num_steps > 1:
        models += [key("decode", shape, device)
                   for shape in shapes.decode_shapes() for device in variants]
    if verify_shapes:
        models += [key("verify", shape, device) for shape in verify_shapes
                   for device in variants]
    moves = [ProgramKey("move_blocks", (size,)) for size in sorted(set(move_sizes))]
    fill = ProgramKey("penalty_fill", (penalty_width,))

    def largest(kind: str) -> list[ProgramKey]:
        keys = [k for k in models if k.kind == kind and k.device_decided == host_decides]
        return [max(keys, key=lambda k: k.bucket)] if keys else []

    ready = [*largest("step"), *largest("step-masked"), *largest("decode"),
             *largest("verify"), *moves[-1:], fill]
    # The model's programs largest first (at equal buckets the host-decided program, the
    # one most batches run once it exists, before the device-decided one), then the
    # smaller block moves.
    order = lambda k: (tuple(-b for b in k.bucket), k.device_decided, KINDS.index(k.kind))  # noqa: E731
    rest = (sorted((k for k in models if k not in ready), key=order)
            + sorted((k for k in moves if k not in ready), key=order))
    return ProgramSet(tuple(ready), tuple(rest))


def smallest_holding(wanted: ProgramKey, held: Iterable[ProgramKey]) -> ProgramKey | None:
    """The held program with the smallest bucket that can run ``wanted``'s batches padded
    (its own variant preferred at equal buckets), or None."""
    fits = [k for k in held if k.holds(wanted)]
    if not fits:
        return None
    return min(fits, key=lambda k: (int(np.prod(k.bucket)), k.bucket,
                                    k.device_decided != wanted.device_decided))


# Fields of ``BatchMetadata`` indexed by token ([T]); every other array is per row ([S, ...]),
# except ``cu_q_lens`` ([S + 1]) and ``num_seqs`` ([1]).
_TOKEN_FIELDS = ("input_ids", "input_src", "positions", "slot_mapping")


def pad_batch(batch: BatchMetadata, empty: BatchMetadata) -> BatchMetadata:
    """``batch`` padded to the larger shape of ``empty`` (a batch of that shape holding no
    sequence: ``BatchBuilder.empty``), by the padding rules of ``BatchMetadata``: padded
    tokens and rows take ``empty``'s values, ``cu_q_lens`` repeats its last value, block
    tables are widened with the null block 0. The rows keep their indices, so a call that
    continues this one (``input_src``, a decode call's ``row_map``) is unaffected."""
    T, S, M = batch.shape_key
    T2, S2, M2 = empty.shape_key
    if T2 < T or S2 < S or M2 < M:
        raise ValueError(f"cannot pad a batch of shape {(T, S, M)} to {(T2, S2, M2)}")
    values = {}
    for name, value in batch.as_dict().items():
        out = np.array(getattr(empty, name), copy=True)
        if name in _TOKEN_FIELDS:
            out[:T] = value
        elif name == "cu_q_lens":
            out[:S + 1] = value
            out[S + 1:] = value[S]
        elif name == "num_seqs":
            out[:] = value
        elif name == "block_tables":
            out[:S, :M] = value
        else:
            out[:S] = value
        values[name] = out
    return BatchMetadata(**values, _features=batch._features)
