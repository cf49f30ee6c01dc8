"""The shapes a batch may take: the bucket ladders of ``T`` (tokens), ``S`` (sequences)
and ``M`` (blocks per sequence), the rules that pick a batch's rungs, and the
enumerations of every shape (for warm-up and ``jaxpage plan``). ``BatchBuilder``
(``jaxpage.core.batch.builder``) builds batches of these shapes.

Every shape is a compiled program (seconds to compile on the CPU, minutes on a TPU, and an
executable to load at a warm start), so the rules keep their number down: see
``seats`` and ``decode_seats``, and ``one_block_rung``.
"""

from __future__ import annotations

from jaxpage.core.batch.bucket_ladder import BucketLadder

# A step with prefill holds at least one sequence seat per this many tokens of its rung
# (``BatchShapes.seats``).
TOKENS_PER_SEAT = 8
# A batch of 2 or more decodes holds at least this many seats (``BatchShapes.decode_seats``).
MIN_DECODE_SEATS = 8
# Decode seat rungs of at least this many seats have a rung at three quarters below them
# (``BatchShapes.decode_seats``).
THREE_QUARTER_RUNGS_FROM = 32


class BatchShapes:
    """The ladders and shape rules of one engine's batches."""

    def __init__(self, *, max_num_batched_tokens: int, max_num_seqs: int, max_blocks: int,
                 bucket_growth: int = 2, one_block_rung: bool = False,
                 additive: bool = False) -> None:
        """``one_block_rung``: every batch's block tables are ``max_blocks`` wide (one rung,
        so the block width never multiplies the programs), for attention kernels whose
        cost does not depend on that width (the C++ CPU kernel, and the GPU and TPU
        Pallas kernels, read each sequence's blocks up to its own length).

        ``additive`` (accelerators): a step's seats depend on its token rung alone
        (``S = min(T, max_num_seqs)``: a step of T tokens holds at most T sequences), and
        an all-decode batch of n sequences has ``T = S =`` the decode rung of n, from a
        ladder of the token ladder's own rungs (16, 32, ... up to the most sequences a
        step can hold), shared by the step and the multi-step decode call. The program
        count is then the sum of the two ladders, not a product: on an accelerator a
        compile costs seconds to minutes, and padding a memory-bound decode to the next
        power of two costs little (the weights are read once either way)."""
        self.additive = additive
        self.token_ladder = BucketLadder(min(16, max_num_batched_tokens), max_num_batched_tokens,
                                         bucket_growth)
        self.seq_ladder = BucketLadder(1, max_num_seqs, bucket_growth)
        # Verify steps (decodes with speculative proposals) pad their tokens from 1 up.
        self.verify_ladder = BucketLadder(1, max_num_batched_tokens, bucket_growth)
        self.block_ladder = BucketLadder(max_blocks if one_block_rung else min(8, max_blocks),
                                         max_blocks, bucket_growth)
        most_decodes = min(max_num_seqs, max_num_batched_tokens)
        self.decode_ladder = BucketLadder(min(16, most_decodes), most_decodes, bucket_growth)

    def seats(self, num_tokens_rung: int, num_seqs: int, decodes_only: bool) -> int:
        """S of a batch: the sequence rung of ``num_seqs``, and for a step with prefill at
        least the rung of ``T / TOKENS_PER_SEAT`` (capped by the largest), so that each
        token rung has one program for every count of sequences up to that, not one per
        sequence rung. The extra rows cost at most 1 / TOKENS_PER_SEAT of a token's work
        each (their logits and sampling); every program avoided is a compile avoided
        (seconds on the CPU, minutes on a TPU) and an executable to load at start-up."""
        if decodes_only:
            return self.decode_seats(num_seqs)
        if self.additive:
            return min(num_tokens_rung, self.seq_ladder.rungs[-1])
        floor = min(num_tokens_rung // TOKENS_PER_SEAT, self.seq_ladder.rungs[-1])
        return self.seq_ladder.fit(max(num_seqs, floor))

    def decode_seats(self, num_seqs: int) -> int:
        """S of a batch of ``num_seqs`` decodes: 1 alone, else the sequence rung of at least
        ``MIN_DECODE_SEATS`` (capped by the largest). A decode of a few rows reads the
        weights once like a decode of 8 (a memory-bound step on every platform: on this
        project's CPU 2 rows cost ~1.2x one row and 8 rows ~1.5x), so rows 2..8 share one
        program instead of three.

        From ``THREE_QUARTER_RUNGS_FROM`` seats up, a power-of-two rung ``r`` also has a
        rung at ``3r / 4`` (24, 48, 96, ...): a decode batch is at most a third padding
        instead of a half. Decodes of this size are compute-bound on the CPU, so every
        padded row costs nearly a live row's matmuls
        (``docs/benchmarks/design_measurements.md``).
        Decodes are where a batch spends most of its steps, so only they get the extra
        rungs (two more programs for 64 sequences)."""
        if self.additive:
            return self.decode_ladder.fit(max(num_seqs, 1))
        if num_seqs <= 1:
            return self.seq_ladder.fit(num_seqs)
        rung = self.seq_ladder.fit(max(num_seqs, min(MIN_DECODE_SEATS, self.seq_ladder.rungs[-1])))
        three_quarters = rung * 3 // 4
        if (rung >= THREE_QUARTER_RUNGS_FROM and rung & (rung - 1) == 0
                and num_seqs <= three_quarters):
            return three_quarters
        return rung

    def decode_tokens(self, num_seqs: int) -> int:
        """T of a batch of ``num_seqs`` decodes: its seats, capped by the token rung."""
        return min(self.decode_seats(num_seqs), self.token_ladder.fit(num_seqs))

    def step_shapes(self) -> list[tuple[int, int, int]]:
        """Every (T, S, M) that ``build`` can produce: n sequences carry n..max tokens
        (decodes only: ``decode_tokens(n)``)."""
        if self.additive:
            most = self.seq_ladder.rungs[-1]
            pairs = {(rung, min(rung, most)) for rung in self.token_ladder.rungs}
            pairs |= {(rung, rung) for rung in self.decode_ladder.rungs}
            return sorted((t, s, m) for t, s in pairs for m in self.block_ladder.rungs)
        pairs = {(self.decode_tokens(n), self.decode_seats(n))
                 for n in range(1, self.seq_ladder.rungs[-1] + 1)}
        max_tokens = self.token_ladder.rungs[-1]
        for n in range(1, self.seq_ladder.rungs[-1] + 1):
            for rung in self.token_ladder.rungs:
                if rung >= n:
                    pairs.add((rung, self.seats(rung, n, decodes_only=False)))
            if n > max_tokens:
                break
        return sorted((t, s, m) for t, s in pairs for m in self.block_ladder.rungs)

    def decode_shapes(self) -> list[tuple[int, int, int]]:
        """Every (T, S, M) of an all-decode batch (n sequences, one token each)."""
        if self.additive:
            return sorted((rung, rung, m) for rung in self.decode_ladder.rungs
                          for m in self.block_ladder.rungs)
        pairs = {(self.decode_tokens(n), self.decode_seats(n))
                 for n in range(1, self.seq_ladder.rungs[-1] + 1)}
        return sorted((t, s, m) for t, s in pairs for m in self.block_ladder.rungs)

    def verify_shapes(self, max_rows: int, max_proposals: int) -> list[tuple[int, int, int]]:
        """Every (T, S, M) of a verify batch (decodes with speculative proposals): up to
        ``max_rows`` sequences, each with its last token and up to ``max_proposals``
        proposals, at least one proposal in the batch."""
        budget = self.verify_ladder.rungs[-1]
        pairs = set()
        for n in range(1, min(max_rows, self.seq_ladder.rungs[-1]) + 1):
            low = self.verify_ladder.fit(min(n + 1, budget))
            high = self.verify_ladder.fit(min(n * (1 + max_proposals), budget))
            seats = self.seq_ladder.fit(n)
            pairs.update((rung, seats) for rung in self.verify_ladder.rungs if low <= rung <= high)
        return sorted((t, s, m) for t, s in pairs for m in self.block_ladder.rungs)


def ladder_policy(platform: str, attention_backend: str) -> dict[str, bool]:
    """``BatchShapes``' keyword choices for a platform ("cpu", "gpu", "tpu") and resolved
    attention backend: one block-table rung when the kernel reads each sequence's blocks
    up to its own length (the C++ CPU kernel and the Pallas GPU / TPU kernels; the plain
    jnp reference gathers the whole table, so it keeps the width rungs), and additive
    ladders on accelerators (the CPU keeps its product ladders, measured faster there:
    docs/benchmarks/startup.md)."""
    return {"one_block_rung": attention_backend in ("cpu", "gpu", "tpu"),
            "additive": platform != "cpu"}
