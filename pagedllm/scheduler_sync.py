"""What the model runner holds of each sequence, as the scheduler last told it.

The runner keeps its own block tables and token lists (runner/), built only from SchedulerOutputs.
``RunnerSync`` is the scheduler's record of them: the block table it last sent each sequence,
how much of that table's head is known released (NULL_BLOCK) runner-side, and the sequences the
runner must drop (finished, or preempted: their blocks are gone or moved). ``describe`` fills a
SchedulerOutput with what brings the runner up to date: all of a sequence it holds nothing of,
else only the tokens and blocks that changed since it was last sent.
"""

from __future__ import annotations

from pagedllm.kv.base import NULL_BLOCK, KVCacheManager
from pagedllm.scheduler_output import CachedSequenceData, NewSequenceData, SchedulerOutput
from pagedllm.sequence import Sequence


class RunnerSync:
    def __init__(self, kv_manager: KVCacheManager) -> None:
        self.kv = kv_manager
        # The block table the runner holds for each sequence, as last sent.
        self._sent_tables: dict[str, list[int]] = {}
        # How many leading entries of each sent table are known released (NULL_BLOCK) runner-side.
        self._sent_released: dict[str, int] = {}
        self._finished_ids: set[str] = set()  # gone since the last describe()
        self._preempted_ids: set[str] = set()
        # Sequences whose tables lost their tail since last sent (rejected drafts' slots), and
        # the length the runner must cut its copy to.
        self._truncated: dict[str, int] = {}

    def finished(self, seq_id: str) -> None:
        """The sequence ended: the runner drops it."""
        self._forget(seq_id)
        self._finished_ids.add(seq_id)

    def preempted(self, seq_id: str) -> None:
        """The sequence lost its device blocks (freed or swapped out): the runner drops its table,
        and gets it whole when the sequence runs again."""
        self._forget(seq_id)
        self._preempted_ids.add(seq_id)

    def truncated(self, seq_id: str, num_blocks: int) -> None:
        """The sequence's table was cut to ``num_blocks`` (its tail given back): the runner cuts its
        copy too before appending what comes next."""
        sent = self._sent_tables.get(seq_id)
        if sent is not None and len(sent) > num_blocks:
            del sent[num_blocks:]
            self._truncated[seq_id] = min(num_blocks, self._truncated.get(seq_id, num_blocks))

    def _forget(self, seq_id: str) -> None:
        self._sent_tables.pop(seq_id, None)
        self._sent_released.pop(seq_id, None)
        self._truncated.pop(seq_id, None)

    def describe(self, out: SchedulerOutput, seqs: dict[str, Sequence]) -> None:
        """Fills in what the runner needs of each scheduled sequence: all of a sequence it holds
        no table for, else the tokens and blocks that changed since it was last sent."""
        out.finished_seq_ids, self._finished_ids = self._finished_ids, set()
        out.preempted_seq_ids, self._preempted_ids = self._preempted_ids, set()
        bs = self.kv.block_size
        for seq_id in out.num_scheduled_tokens:
            seq = seqs[seq_id]
            table = self.kv.block_table(seq_id)
            sent = self._sent_tables.get(seq_id)
            if sent is None:
                out.new_seqs.append(
                    NewSequenceData(
                        seq_id,
                        list(seq.all_token_ids),
                        seq.num_prompt_tokens,
                        list(table),
                        seq.num_computed_tokens,
                        seq.sampling_params,
                        seq.seed,
                        seq.needs_prompt_logprobs,
                    )
                )
                out.preempted_seq_ids.discard(seq_id)
            else:
                # Only blocks from the first one this step writes can have been replaced (COW).
                first = min(seq.num_computed_tokens // bs, len(sent))
                replaced = [(j, table[j]) for j in range(first, len(sent)) if table[j] != sent[j]]
                # ... and, before them, blocks released out of the sliding window (a prefix).
                k = self._sent_released.get(seq_id, 0)
                while k < first and table[k] == NULL_BLOCK:
                    if sent[k] != NULL_BLOCK:
                        replaced.append((k, NULL_BLOCK))
                    k += 1
                self._sent_released[seq_id] = k
                for j, b in replaced:
                    sent[j] = b
                new_blocks = table[len(sent) :]
                sent.extend(new_blocks)
                out.cached_seqs.append(
                    CachedSequenceData(
                        seq_id,
                        seq.all_token_ids[seq.num_tokens_sent :],
                        list(new_blocks),
                        replaced,
                        seq.num_computed_tokens,
                        self._truncated.pop(seq_id, None),
                    )
                )
            if sent is None:
                self._sent_released[seq_id] = 0
            self._sent_tables[seq_id] = list(table) if sent is None else sent
            seq.num_tokens_sent = seq.num_tokens

    def step_failed(self, out: SchedulerOutput) -> None:
        """The runner raised on ``out``: what it holds of the scheduled sequences is unknown, so
        they are sent whole next time, and the drops ``out`` carried are sent again."""
        for seq_id in out.num_scheduled_tokens:
            self._forget(seq_id)
        self._finished_ids |= out.finished_seq_ids
        self._preempted_ids |= out.preempted_seq_ids
