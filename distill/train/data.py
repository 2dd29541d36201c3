"""Batches for distillation: padded sequences with their loss masks (and cached top-k teacher rows).

A DataLoader item is one *optimizer step* on this rank: a list of `grad_accum` micro-batches. Knowing the whole
step up front lets the module normalise every micro-batch by the step's global token count (exact gradient
accumulation). The train loader (`PositionedLoader`, a torchdata `StatefulDataLoader`) over a
`StatefulDistributedSampler` records its position (epoch, batches) in each checkpoint, so resume continues
mid-epoch with exactly the next batch, whatever train.num_workers is on either side.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from distill.errors import InputError
from distill.losses import SparseTeacher
from distill.train.parallel import ParallelView, build_parallel_view


@dataclass(frozen=True)
class Parallel:
    """Parallel drafting (PARD) training: `tokens` proposals per round, masks are `mask_token_id`, and the share
    of anchors whose mask group is trained (`train.parallel_mask_fraction`)."""

    tokens: int
    mask_token_id: int
    mask_fraction: float = 1.0


@dataclass
class MicroBatch:
    """One padded micro-batch. B sequences of length T, N counted tokens.

    input_ids/attention_mask/loss_mask: int64 [B, T]; positions: int64 [N] position of each counted token in
    its response (0 = first response token), row-major like `losses.select_labels`; teacher: the cached top-k
    rows [N, k] or None (online teacher); rows: dataset row indices [B]; parallel: the packed input of a
    parallel-drafting draft (`distill.train.parallel`), None for an ordinary draft; packed: an ordinary
    draft's input with several sequences per row (train.pack_sequences: the view of `build_parallel_view`
    with k = 1, one prediction per counted token, in their order), None when its [B, T] input is used as is.
    """

    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    positions: Tensor
    teacher: SparseTeacher | None
    rows: Tensor
    parallel: ParallelView | None = None
    packed: ParallelView | None = None

    @property
    def num_tokens(self) -> int:
        """Counted predictions: response tokens, or every proposal of a parallel draft."""
        if self.parallel is not None:
            return int(self.parallel.predict_at.numel())
        return int(self.loss_mask.sum())

    def to(self, device: torch.device | str) -> MicroBatch:
        t = self.teacher
        if t is not None:
            t = SparseTeacher(t.ids.to(device), t.logprobs.to(device), t.rest_logmass.to(device))
        return MicroBatch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.loss_mask.to(device),
            self.positions.to(device),
            t,
            self.rows.to(device),
            None if self.parallel is None else self.parallel.to(device),
            None if self.packed is None else self.packed.to(device),
        )


class DistillRows(Dataset):
    """Rows of one split, cut to `max_seq_len`; rows left without a response token are dropped."""

    def __init__(self, ds: Any, cache: Any | None, max_seq_len: int, indices: list[int] | None = None):
        self.ds = ds
        self.cache = cache
        self.max_seq_len = max_seq_len
        if indices is None:
            indices = [i for i, m in enumerate(ds["loss_mask"]) if sum(m[:max_seq_len]) > 0]
        self.indices = indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict[str, Any]:
        row_idx = self.indices[i]
        row = self.ds[row_idx]
        ids = list(row["input_ids"][: self.max_seq_len])
        mask = list(row["loss_mask"][: self.max_seq_len])
        item: dict[str, Any] = {"input_ids": ids, "loss_mask": mask, "row": row_idx}
        if self.cache is not None:
            n = sum(mask)
            t_ids, t_lp, t_rest = self.cache.get(row_idx)
            # Truncation cuts from the right, so the kept response tokens are the first n cache rows.
            item["topk"] = (t_ids[:n], t_lp[:n], t_rest[:n])
        return item


def collate_micro(
    items: list[dict[str, Any]], pad_id: int, parallel: Parallel | None = None, pack: bool = False
) -> MicroBatch:
    """Right-pad a list of rows into one `MicroBatch` (padding: attention 0, loss 0); with `pack`, the draft's
    input also packs several rows into one where they fit (`distill.train.parallel.pack_rows`)."""
    t_max = max(len(it["input_ids"]) for it in items)
    b = len(items)
    ids = torch.full((b, t_max), pad_id, dtype=torch.long)
    attn = torch.zeros((b, t_max), dtype=torch.long)
    mask = torch.zeros((b, t_max), dtype=torch.long)
    for r, it in enumerate(items):
        n = len(it["input_ids"])
        ids[r, :n] = torch.tensor(it["input_ids"], dtype=torch.long)
        attn[r, :n] = 1
        mask[r, :n] = torch.tensor(it["loss_mask"], dtype=torch.long)
    positions = (mask.cumsum(dim=1) - 1)[mask.bool()]
    teacher = None
    if "topk" in items[0]:
        teacher = SparseTeacher(
            ids=torch.cat([it["topk"][0] for it in items]),
            logprobs=torch.cat([it["topk"][1] for it in items]),
            rest_logmass=torch.cat([it["topk"][2] for it in items]),
        )
    rows = torch.tensor([it["row"] for it in items], dtype=torch.long)
    view = packed = None
    if parallel is not None:
        view = build_parallel_view(
            ids,
            attn,
            mask,
            k=parallel.tokens,
            mask_token_id=parallel.mask_token_id,
            pad_id=pad_id,
            row_ids=rows.tolist(),
            mask_fraction=parallel.mask_fraction,
            pack=pack,
        )
    elif pack:
        packed = build_parallel_view(ids, attn, mask, k=1, mask_token_id=pad_id, pad_id=pad_id, pack=True)
        if packed.predict_at.numel() != positions.numel():  # a counted first token has no prediction
            packed = None
    return MicroBatch(ids, attn, mask, positions, teacher, rows, view, packed)


def collate_step(
    items: list[dict[str, Any]],
    *,
    micro_batch: int,
    pad_id: int,
    parallel: Parallel | None = None,
    pack: bool = False,
) -> list[MicroBatch]:
    """One optimizer step's rows -> micro-batches of `micro_batch` rows, each padded to its own length."""
    return [
        collate_micro(items[i : i + micro_batch], pad_id, parallel, pack)
        for i in range(0, len(items), micro_batch)
    ]


def load_rows(run_dir: Path, split: str, *, cached: bool, max_seq_len: int) -> DistillRows:
    """The split's rows (and top-k cache when `cached`). Raises `InputError` when the data is missing."""
    from distill.data.format import load_split_dataset, open_topk_cache

    ds = load_split_dataset(run_dir, split)
    cache = None
    if cached:
        cache = open_topk_cache(run_dir, split)
        if cache is None:
            raise InputError(
                f"train.teacher: 'cached' needs the data stage's top-k cache for the {split} split "
                f"({run_dir}/data/topk/{split} is missing). Rerun `distill data` with data.logits.top_k=64 "
                "(for example), or set train.teacher=online."
            )
        if len(cache) != len(ds):
            raise InputError(
                f"{run_dir}/data/topk/{split}: {len(cache)} cache rows for {len(ds)} dataset rows; the data folder "
                "is inconsistent. Rerun `distill data` with data.overwrite=true."
            )
    return DistillRows(ds, cache, max_seq_len)


POSITION = "distill_position"


class PositionedLoader(StatefulDataLoader):
    """The train loader, whose checkpointed state is its position: the sampler's epoch and the batches handed out
    in it. torchdata's own state is a snapshot per worker process, which cannot be restored with another
    train.num_workers (a run_only key); the position can, and the seeded sampler makes the same batches from it.

    The sampler must be a `StatefulDistributedSampler` and every batch full (`drop_last`), so that batches x
    batch_size is the number of this rank's rows used.
    """

    # Where a resumed epoch started: its iterator counts batches from 0 again, so the position it reports adds
    # the batches handed out before the resume (only while that epoch lasts).
    _resumed_at: tuple[int | None, int] = (None, 0)

    def state_dict(self) -> dict[str, Any]:
        it = self._iterator
        epoch = int(self.sampler.epoch)
        resumed_epoch, resumed_batches = self._resumed_at
        batches = (0 if it is None else int(it._num_yielded)) + (
            resumed_batches if resumed_epoch == epoch else 0
        )
        return {POSITION: {"epoch": epoch, "batches": batches}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        position = state_dict.get(POSITION) or legacy_position(state_dict)
        super().load_state_dict({})  # no iterator snapshot: the next iterator starts at the position
        if position is None:
            return
        epoch, batches = position.get("epoch"), int(position["batches"])
        if batches >= len(self):
            # The checkpoint came after the epoch's last batch: Lightning goes on with the next epoch, which
            # must start at its beginning (skipping it whole would train on another epoch's order).
            epoch, batches = (None if epoch is None else epoch + 1), 0
        if epoch is not None:
            # Lightning sets the epoch too, but only after a worker process may have drawn its first indices.
            self.sampler.set_epoch(int(epoch))
        self.sampler.load_state_dict({"yielded": batches * int(self.batch_size or 1)})
        self._resumed_at = (int(self.sampler.epoch), batches)


def legacy_position(state: dict[str, Any]) -> dict[str, int] | None:
    """The position in a checkpoint written before `PositionedLoader` (torchdata's state: `_num_yielded` of the
    single-process iterator, a snapshot step plus the steps since of the multi-process one); epoch unknown."""
    if "_num_yielded" in state:
        return {"batches": int(state["_num_yielded"])}
    snapshot = state.get("_snapshot")
    if isinstance(snapshot, dict) and "_snapshot_step" in snapshot:
        return {"batches": int(snapshot["_snapshot_step"]) + int(state.get("_steps_since_snapshot", 0))}
    return None


class DistillDataModule(L.LightningDataModule):
    """Train and val loaders over `run_dir/data`. State is built in `setup()` (runs on every rank)."""

    def __init__(
        self,
        run_dir: Path,
        *,
        batch_size: int,
        grad_accum: int,
        max_seq_len: int,
        cached: bool,
        pad_id: int,
        seed: int,
        num_workers: int = 0,
        parallel: Parallel | None = None,
        pack: bool = False,
    ):
        super().__init__()
        self.run_dir = Path(run_dir)
        self.batch_size = batch_size
        self.grad_accum = grad_accum
        self.max_seq_len = max_seq_len
        self.cached = cached
        self.pad_id = pad_id
        self.seed = seed
        self.num_workers = num_workers
        self.parallel = parallel
        self.pack = pack  # train.pack_sequences
        self.train_rows: DistillRows | None = None
        self.val_rows: DistillRows | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_rows is None:
            self.train_rows = load_rows(
                self.run_dir, "train", cached=self.cached, max_seq_len=self.max_seq_len
            )
        if self.val_rows is None:
            self.val_rows = load_rows(self.run_dir, "val", cached=self.cached, max_seq_len=self.max_seq_len)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return [mb.to(device) for mb in batch]

    def _world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 1, 0
        return trainer.world_size, trainer.global_rank

    def train_dataloader(self) -> Any:
        from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

        assert self.train_rows is not None
        world, rank = self._world()
        sampler = StatefulDistributedSampler(
            self.train_rows, num_replicas=world, rank=rank, shuffle=True, seed=self.seed, drop_last=True
        )
        return PositionedLoader(
            self.train_rows,
            batch_size=self.batch_size * self.grad_accum,
            sampler=sampler,
            drop_last=True,
            collate_fn=partial(
                collate_step,
                micro_batch=self.batch_size,
                pad_id=self.pad_id,
                parallel=self.parallel,
                pack=self.pack,
            ),
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        assert self.val_rows is not None
        world, rank = self._world()
        # Validation measures every mask group (the subsampling only saves training compute).
        full = None if self.parallel is None else replace(self.parallel, mask_fraction=1.0)
        return val_loader(
            self.val_rows, self.batch_size, self.pad_id, world=world, rank=rank, parallel=full, pack=self.pack
        )


def val_loader(
    rows: DistillRows,
    batch_size: int,
    pad_id: int,
    *,
    world: int = 1,
    rank: int = 0,
    parallel: Parallel | None = None,
    pack: bool = False,
) -> DataLoader:
    """Validation rows of this rank (every row exactly once over all ranks, so summed figures are exact)."""
    shard = DistillRows(rows.ds, rows.cache, rows.max_seq_len, rows.indices[rank::world])
    return DataLoader(
        shard,
        batch_size=batch_size,
        shuffle=False,
        collate_fn=partial(collate_step, micro_batch=batch_size, pad_id=pad_id, parallel=parallel, pack=pack),
    )
