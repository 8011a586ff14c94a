"""Decode steps replayed as a CUDA graph (optional; GPU only).

A decode step of a small model at small batch is bound by kernel launches and Python, not by the
GPU: SmolLM2 runs ~10 ops x 30 layers per token. ``GraphDecoder`` captures one decode step of a
fixed batch of sequences once, with static input buffers (token ids, positions, slots, block
tables padded to the longest context, sequence lengths), and replays it each step after copying
the new step's metadata in. The model code is the same as the eager step: ``forward`` never
synchronizes with the host, and every qops op takes its scales and lengths as device tensors.
"""

from __future__ import annotations

import torch

from .layers import StepContext
from .model import token_rows


class GraphDecoder:
    """One captured decode step for the sequences ``seq_ids`` (all already in ``cache``).

    ``step(tokens)`` appends one token per sequence and returns float32 logits ``[B, V]`` (a
    static buffer, overwritten by the next step). ``max_context`` bounds the sequences' lengths
    (it fixes the width of the block tables). ``capture=False`` runs the same static-buffer step
    eagerly (any device; what the CPU tests check).
    """

    def __init__(self, model, cache, seq_ids, max_context: int, *, capture: bool = True) -> None:
        dev = model.device
        if capture and dev.type != "cuda":
            raise RuntimeError(
                "GraphDecoder needs a CUDA model (capture=False runs the same static-buffer "
                "step eagerly, on any device)"
            )
        self.capture = capture
        self.model, self.cache, self.seq_ids = model, cache, list(seq_ids)
        b = len(self.seq_ids)
        if b == 0 or len(set(self.seq_ids)) != b:
            raise ValueError("GraphDecoder: seq_ids must be one or more distinct sequences")
        for sid in self.seq_ids:
            cache.seq_len(sid)  # KeyError naming an unknown sequence
        self.max_blocks = -(-max_context // cache.block_size)
        model.rotary.ensure(max_context)
        self.ids = torch.zeros(b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, dtype=torch.long, device=dev)
        self.slots = torch.zeros(b, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(b, self.max_blocks, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=dev)
        self.ctx = StepContext(
            cache=cache,
            positions=self.positions,
            slot_mapping=self.slots,
            query_lens=[1] * b,
            decode=True,
            block_tables=self.block_tables,
            seq_lens=self.seq_lens,
        )
        if cache.skvq:  # the SKVQ write: one token per sequence, and each sequence's side slot
            self.ctx.cu_seqlens = torch.arange(b + 1, dtype=torch.int32, device=dev)
            self.ctx.side_slots = cache.side_slots(self.seq_ids)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def _load(self, tokens: list[int]) -> None:
        c, sid = self.cache, self.seq_ids
        slots = c.append_slots(sid, 1)
        lens = c.seq_lens(sid)
        self.ids.copy_(torch.as_tensor(tokens, dtype=torch.long), non_blocking=True)
        self.slots.copy_(slots)
        self.seq_lens.copy_(lens)
        self.positions.copy_(lens.long() - 1)
        self.block_tables.copy_(c.block_tables(sid, self.max_blocks))
        if self.ctx.side_slots is not None:
            self.ctx.side_slots.copy_(c.side_slots(sid))

    @torch.no_grad()
    def step(self, tokens) -> torch.Tensor:
        """Append ``tokens`` (one int per sequence, in ``[0, vocab_size)``) and run the step.
        Transactional like ``model.step``: checked first; a step that raises leaves the cache as
        it was."""
        rows = token_rows([tokens], self.model.args.vocab_size, "GraphDecoder.step")[0]
        if len(rows) != len(self.seq_ids):
            raise ValueError(f"GraphDecoder.step: {len(rows)} tokens for {len(self.seq_ids)} sequences")
        lens = [self.cache.seq_len(s) for s in self.seq_ids]
        if max(lens) + 1 > self.max_blocks * self.cache.block_size:
            raise ValueError(
                f"GraphDecoder.step: a sequence would grow to {max(lens) + 1} tokens, past "
                f"max_context = {self.max_blocks * self.cache.block_size}"
            )
        with self.cache.transaction():
            return self._run(rows)

    def _run(self, tokens: list[int]) -> torch.Tensor:
        self._load(tokens)
        if not self.capture:
            return self.model(self.ids, self.ctx)
        if self.graph is None:
            # warm up on a side stream (allocator, lazy inits), then capture; both write the
            # same K/V to the same slots as the replay, so the cache stays consistent
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                self.model(self.ids, self.ctx)
            torch.cuda.current_stream().wait_stream(s)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self.model(self.ids, self.ctx)
        self.graph.replay()
        assert self.logits is not None  # the capture's output buffer, set with self.graph
        return self.logits
