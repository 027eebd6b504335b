"""Per-backend padding conventions: what a padded request row of a FULL graph holds, by attention backend.

Every backend in vLLM 0.32 gets the same padded rows from the runner (gpu_model_runner `_build_attention_metadata`:
query_start_loc repeats the real token count, seq_lens 0, block-table rows NULL_BLOCK_ID); what differs is what a
backend's kernel can read without faulting, and so what its metadata builder rewrites:

- FlashAttention: seq_lens 0 and query lengths 0 are skipped by the varlen kernel; FA3's scheduler metadata is
  sized by the padded num_reqs, so a FULL graph must be replayed with the request count it was captured for
  (vLLM #35918).
- FlashInfer: seq_lens 0 (the paged-KV last-page length of a padded row is then 0 and it owns no page; FlashInfer
  requires 0 there under graph capture, SGLang #1469).
- FlashMLA (its fp8 decode kernel): seq_lens clamped to 1 and block-table entries to >= 0 (vLLM PR #35969, issue
  #33664): seq_len 0 makes the kernel index block_table[-1]. Block-table rows are 0 in slotmap for every profile,
  so only seq_lens differs.

A padded row's seq_len 1 reads one key from block 0 (the null block, never real KV, spec/types.py): harmless,
its output is discarded.
"""

from __future__ import annotations

from dataclasses import dataclass

from spec.types import is_integral


@dataclass(frozen=True)
class PaddingProfile:
    name: str
    pad_seq_len: int  # seq_lens of a padded request row (0, or 1 for a kernel that cannot take 0)

    def __post_init__(self) -> None:
        if not is_integral(self.pad_seq_len) or self.pad_seq_len < 0:
            raise ValueError(f"PaddingProfile.pad_seq_len must be an integer >= 0, got {self.pad_seq_len!r}")


FLASH_ATTENTION = PaddingProfile("flash_attn", pad_seq_len=0)
FLASHINFER = PaddingProfile("flashinfer", pad_seq_len=0)
FLASHMLA = PaddingProfile("flashmla", pad_seq_len=1)
PROFILES = {p.name: p for p in (FLASH_ATTENTION, FLASHINFER, FLASHMLA)}
