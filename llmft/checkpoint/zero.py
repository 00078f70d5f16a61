"""Read DeepSpeed ZeRO checkpoints (stages 0-3, any number of ranks) straight from their shard files.

Why not `deepspeed.utils.zero_to_fp32`? It concatenates every rank's fp32 partition into a second full
copy before slicing parameters out, and for inference we want nothing but the weights. This reader
mirrors its reconstruction protocol exactly (same offsets, paddings and shared-parameter rules, so
the result is bit-identical), but it:

- starts no process group and no DeepSpeed engine, and does not even import DeepSpeed;
- opens every shard with ``torch.load(..., mmap=True, weights_only=True)``, so the optimizer moments
  (``exp_avg``, ``exp_avg_sq``) stay unread pages of a file mapping and never enter memory;
- copies each rank's slice of every parameter straight into the destination tensors (which may be
  the parameters of an already-built model, in any dtype, on any device) and then drops that rank's
  mapping, so peak memory is about the model itself plus one rank's fp32 partition.

    from llmft.checkpoint.zero import open_checkpoint, load_fp32_state_dict
    ckpt = open_checkpoint("out/checkpoint-4/global_step4")    # validates the shards, reads metadata
    print(ckpt.stage, ckpt.world_size, ckpt.shapes)
    state_dict = load_fp32_state_dict("out/checkpoint-4/global_step4")
"""

from __future__ import annotations

import enum
import math
import pickle
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llmft.checkpoint.run_dir import CheckpointError  # one error type for checkpoint problems a user can fix

MODEL_STATES_Z012 = "mp_rank_00_model_states.pt"
_RANK_RE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_(model|optim)_states\.pt$")


# --------------------------------------------------------------------------------------------------
# Safe unpickling. DeepSpeed pickles three small non-tensor objects into its optimizer shards. Rather
# than `weights_only=False` (which would run any code a checkpoint carries), we allow exactly those
# three names and map them to inert stand-ins that only hold the pickled data; no DeepSpeed code runs.


class _LossScaler:
    """Stand-in for deepspeed.runtime.fp16.loss_scaler.LossScaler (we never use the loss scale)."""

    def __setstate__(self, state):
        self.__dict__.update(state)


@dataclass
class _FragmentAddress:
    """Stand-in for deepspeed.utils.tensor_fragment.fragment_address (a numel/start pair)."""

    numel: int = 0
    start: int = 0


class _ZeroStageEnum(enum.IntEnum):
    """Stand-in for deepspeed.runtime.zero.config.ZeroStageEnum (an IntEnum with these members)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


# Python pickles an enum member in one of two ways, depending on the interpreter: by value,
# `ZeroStageEnum(2)` (3.10, 3.11.5+, 3.12, 3.13), or by name, `getattr(ZeroStageEnum, 'gradients')`
# (3.11.0-3.11.4, e.g. Debian 12's 3.11.2). The by-name form needs `builtins.getattr`, which safe
# loading must never grant in general: this one only looks up a member of the allowed enum stand-in.
_ENUMS = (_ZeroStageEnum,)


def _member_getattr(obj, name):
    """`builtins.getattr` as a checkpoint may call it: a member of an allowed enum, nothing else."""
    if obj in _ENUMS and isinstance(name, str) and name in obj.__members__:
        return obj[name]
    target = "ZeroStageEnum" if obj in _ENUMS else getattr(obj, "__qualname__", type(obj).__name__)
    raise pickle.UnpicklingError(f"Unsupported global: GLOBAL builtins.getattr on {target}.{name}")


_DEEPSPEED_GLOBALS = [
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
    (_ZeroStageEnum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_member_getattr, "builtins.getattr"),
]


def load_shard(path: Path, trust: bool = False) -> dict:
    """Memory-map one shard file; tensors are lazy views into the mapping until something reads them.

    With ``trust=False`` only tensors, plain containers and the DeepSpeed stand-ins above may be
    unpickled; anything else is refused with an error that explains the ``--trust_checkpoint`` escape.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"shard {path} is missing: the checkpoint is incomplete, copy the file over or use another checkpoint"
        )
    if not zipfile.is_zipfile(path):
        raise CheckpointError(
            f"shard {path} is truncated or corrupt (not a readable torch zip archive): re-copy it or use another checkpoint"
        )
    try:
        if trust:
            return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        with torch.serialization.safe_globals(_DEEPSPEED_GLOBALS):
            return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+(?: on [\w.]+)?)", str(e))
        what = f"the Python object {found.group(1)}" if found else "a Python object"
        raise CheckpointError(
            f"shard {path} contains {what} that safe loading refuses: if you trust this checkpoint, "
            "pass --trust_checkpoint (full pickle: it can run code stored in the file)"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"shard {path} is truncated or corrupt ({reason}): re-copy it or use another checkpoint"
        ) from None


# --------------------------------------------------------------------------------------------------
# Layout discovery


def is_tag_dir(path: Path) -> bool:
    """A tag directory (``global_stepN``) holds the ``*model_states.pt`` shards."""
    return path.is_dir() and any(path.glob("*model_states.pt"))


def _ranked(files: list[Path]) -> dict[int, Path]:
    out = {}
    for f in files:
        m = _RANK_RE.search(f.name)
        if m:
            out[int(m.group(1))] = f
    return out


def _numel(shape) -> int:
    return math.prod(shape)


@dataclass
class ZeroCheckpoint:
    """What a tag directory holds: stage, world size, the shard files and every tensor's full shape.

    ``shapes`` lists each stored tensor by its name in the trained module's ``state_dict`` (trainable
    parameters, frozen parameters and persistent buffers). ``shared`` maps a tied name to the name it
    shares storage with (GPT-2's ``lm_head.weight`` -> ``transformer.wte.weight``).
    """

    tag_dir: Path
    stage: int
    world_size: int
    model_files: list[Path]
    optim_files: list[Path]
    shapes: dict[str, torch.Size]
    shared: dict[str, str]
    trust: bool = False
    ds_version: str | None = None
    _meta: dict = field(default_factory=dict, repr=False)

    @property
    def step(self) -> int | None:
        m = re.search(r"(\d+)$", self.tag_dir.name)
        return int(m.group(1)) if m else None

    def numel(self) -> int:
        return sum(_numel(s) for n, s in self.shapes.items() if n not in self.shared)

    def read_into(self, dest: dict[str, torch.Tensor]) -> None:
        """Copy every stored tensor into ``dest[name]`` (any dtype/device, shape must match), rank by rank.

        Names missing from ``dest`` are skipped; shared (tied) names are filled through their source.
        """
        dest = {n: t for n, t in dest.items() if n in self.shapes and n not in self.shared}
        for name, t in dest.items():
            if tuple(t.shape) != tuple(self.shapes[name]):
                raise CheckpointError(
                    f"shape mismatch for {name}: checkpoint has {tuple(self.shapes[name])}, model has {tuple(t.shape)}"
                )
        if self.stage == 0 and not self.optim_files:
            _read_module(self, dest)
        elif self.stage <= 2:
            _read_zero12(self, dest)
        else:
            _read_zero3(self, dest)

    def release(self) -> None:
        """Drop the file mappings kept for reading (shapes and metadata stay); read_into() is then unavailable."""
        self._meta = {k: v for k, v in self._meta.items() if k in ("paddings",)}


def open_checkpoint(tag_dir: str | Path, trust: bool = False) -> ZeroCheckpoint:
    """Validate a tag directory's shards and read its metadata (cheap: no weights are read)."""
    tag_dir = Path(tag_dir)
    if not tag_dir.exists():
        raise CheckpointError(f"{tag_dir} does not exist: check the path")
    zero3_models = _ranked(sorted(tag_dir.glob("*zero_pp_rank_*_mp_rank_*_model_states.pt")))
    optim = _ranked(sorted(tag_dir.glob("*zero_pp_rank_*_mp_rank_*_optim_states.pt")))
    z012_model = tag_dir / MODEL_STATES_Z012
    if not zero3_models and not z012_model.is_file() and optim:
        raise CheckpointError(
            f"{tag_dir} has optimizer shards but no {MODEL_STATES_Z012} (parameter names and shapes): "
            "copy it over or use another checkpoint"
        )
    if not zero3_models and not z012_model.is_file():
        raise CheckpointError(
            f"{tag_dir} holds no DeepSpeed shards (*model_states.pt): pass a global_stepN directory, a checkpoint-N directory or a run's output directory"
        )
    if zero3_models:
        return _open_zero3(tag_dir, zero3_models, optim, trust)
    return _open_zero012(tag_dir, z012_model, optim, trust)


def _world_size(meta: dict, path: Path) -> int:
    ws = meta.get("dp_world_size")
    if not isinstance(ws, int) or ws < 1:
        raise CheckpointError(f"{path} has no dp_world_size: it is not a DeepSpeed model-states file")
    return ws


def _check_ranks(tag_dir: Path, found: dict[int, Path], world_size: int, pattern: str) -> list[Path]:
    missing = [r for r in range(world_size) if r not in found]
    if missing:
        r = missing[0]
        raise CheckpointError(
            f"missing shard for rank {r} of {world_size} in {tag_dir}: expected {pattern.format(rank=r)} "
            "(not every rank finished writing: copy it over or use an earlier checkpoint)"
        )
    extra = sorted(r for r in found if r >= world_size)
    if extra:
        raise CheckpointError(
            f"{tag_dir} has a shard for rank {extra[0]} but the checkpoint was written by {world_size} ranks: "
            "shards from two runs are mixed, use a clean checkpoint directory"
        )
    return [found[r] for r in range(world_size)]


def _optim_name(optim: dict[int, Path], kind: str = "optim") -> str:
    prefix = "bf16_" if any(p.name.startswith("bf16_") for p in optim.values()) else ""
    return prefix + "zero_pp_rank_{rank}_mp_rank_00_" + kind + "_states.pt"


def _open_zero012(tag_dir, model_file, optim, trust) -> ZeroCheckpoint:
    meta = load_shard(model_file, trust)
    if "module" not in meta:
        raise CheckpointError(f"{model_file} has no 'module' entry: it is not a DeepSpeed model-states file")
    world_size = _world_size(meta, model_file)
    module = meta["module"]
    buffers = set(meta.get("buffer_names") or [])
    param_shapes = meta.get("param_shapes")
    if not optim or not param_shapes:
        # Stage 0: full weights are in `module`; with fp16/bf16 the exact fp32 masters are in the
        # (unpartitioned) optimizer state of the same file.
        shapes = {k: v.shape for k, v in module.items()}
        shared = _shared_from_storage(module)
        return ZeroCheckpoint(
            tag_dir, 0, world_size, [model_file], [], shapes, shared, trust, meta.get("ds_version"), _meta=meta
        )
    optim_files = _check_ranks(tag_dir, optim, world_size, _optim_name(optim))
    first = load_shard(optim_files[0], trust)
    osd = first.get("optimizer_state_dict", {})
    if "single_partition_of_fp32_groups" not in osd:
        raise CheckpointError(f"{optim_files[0]} has no fp32 partitions: it is not a ZeRO stage 1/2 optimizer shard")
    # BF16_Optimizer (bf16 without ZeRO) writes the same partitions but no zero_stage: ask the config
    stage = int(osd.get("zero_stage", (meta.get("ds_config") or {}).get("zero_optimization", {}).get("stage", 2)))
    shapes = {}
    for k in buffers:
        shapes[k] = module[k].shape
    frozen = meta.get("frozen_param_shapes") or {}
    shapes.update({k: torch.Size(v) for k, v in frozen.items()})
    for group in param_shapes:
        shapes.update({k: torch.Size(v) for k, v in group.items()})
    shared = {k: v for k, v in (meta.get("shared_params") or {}).items() if v in shapes}
    for k, v in shared.items():
        shapes[k] = shapes[v]
    ckpt = ZeroCheckpoint(
        tag_dir,
        stage,
        world_size,
        [model_file],
        optim_files,
        shapes,
        shared,
        trust,
        meta.get("ds_version"),
        _meta=meta,
    )
    ckpt._meta["paddings"] = osd.get("param_alignment_paddings")
    return ckpt


def _open_zero3(tag_dir, zero3_models, optim, trust) -> ZeroCheckpoint:
    meta = load_shard(zero3_models[min(zero3_models)], trust)
    world_size = _world_size(meta, zero3_models[min(zero3_models)])
    model_files = _check_ranks(tag_dir, zero3_models, world_size, "zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
    meta = load_shard(model_files[0], trust)
    if not optim:
        raise CheckpointError(
            f"{tag_dir} has ZeRO-3 model shards but no *_optim_states.pt files, which hold the weights: copy them over or use another checkpoint"
        )
    optim_files = _check_ranks(tag_dir, optim, world_size, _optim_name(optim))
    first = load_shard(optim_files[0], trust)
    if "fp32_flat_groups" not in first.get("optimizer_state_dict", {}):
        raise CheckpointError(f"{optim_files[0]} has no fp32_flat_groups: it is not a ZeRO stage 3 optimizer shard")
    module = meta["module"]
    shapes = {k: module[k].shape for k in (meta.get("buffer_names") or [])}
    shapes.update({k: torch.Size(v) for k, v in (meta.get("frozen_param_shapes") or {}).items()})
    for group in meta.get("param_shapes") or []:
        shapes.update({k: torch.Size(v) for k, v in group.items()})
    shared = {k: v for k, v in (meta.get("shared_params") or {}).items() if v in shapes}
    for k, v in shared.items():
        shapes[k] = shapes[v]
    return ZeroCheckpoint(
        tag_dir, 3, world_size, model_files, optim_files, shapes, shared, trust, meta.get("ds_version"), _meta=meta
    )


def _shared_from_storage(module: dict) -> dict[str, str]:
    """Stage 0 saves tied tensors once; detect ties by shared storage (first name is the source)."""
    seen: dict[tuple, str] = {}
    shared = {}
    for k, v in module.items():
        if not isinstance(v, torch.Tensor) or v.numel() == 0:
            continue
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), tuple(v.stride()))
        if key in seen:
            shared[k] = seen[key]
        else:
            seen[key] = k
    return shared


# --------------------------------------------------------------------------------------------------
# Reconstruction (mirrors deepspeed/utils/zero_to_fp32.py, but streams rank by rank into `dest`)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src.view(dst.shape))


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1)


try:
    import ctypes
    import mmap

    _libc = ctypes.CDLL(None, use_errno=True)
    _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _MADV_WILLNEED, _MADV_DONTNEED = 3, 4  # Linux and macOS
except (OSError, AttributeError):  # no libc madvise (Windows): pages are released when the shard is
    _libc = None


def _prefetch(src: torch.Tensor) -> None:
    """Ask the kernel to read a shard region ahead (one large read instead of a fault per page)."""
    if _libc is None or src.device.type != "cpu" or src.numel() == 0:
        return
    page = mmap.PAGESIZE
    start = src.data_ptr() // page * page
    _libc.madvise(start, src.data_ptr() + src.numel() * src.element_size() - start, _MADV_WILLNEED)


def _drop_pages(src: torch.Tensor) -> None:
    """Release the pages of a slice of a memory-mapped shard once it has been copied.

    Read pages of a file mapping count towards RSS until the mapping goes away; dropping them as we go
    keeps peak memory at the model plus a page or two instead of the model plus a rank's partition.
    Only whole pages inside `src` are dropped, and the mapping is private and never written, so a
    later read of the same bytes would simply fault them back in from the file.
    """
    if _libc is None or src.device.type != "cpu" or src.numel() == 0:
        return
    start = src.data_ptr()
    end = start + src.numel() * src.element_size()
    page = mmap.PAGESIZE
    a, b = -(-start // page) * page, end // page * page
    if b > a:
        _libc.madvise(a, b - a, _MADV_DONTNEED)


def _stage0_masters(meta: dict, shared: dict, buffers: set) -> dict[str, torch.Tensor]:
    """Stage 0 with fp16/bf16: map the optimizer's fp32 master copies to parameter names.

    DeepSpeed's FP16 optimizers store masters by parameter group (``fp32_groups``, or one flat tensor
    per group in ``fp32_groups_flat``), not by name. Within a group they keep the model's parameter
    order, and each 16-bit module weight is its master rounded, so every master is given to the
    first unclaimed same-shaped parameter, in model order, whose stored weight equals it rounded.
    Returns {} (use the 16-bit weights) if a checkpoint does not fit this pattern.
    """
    module, opt = meta["module"], meta.get("optimizer")
    if not isinstance(opt, dict):
        return {}
    lowp = [
        k
        for k, v in module.items()
        if k not in shared and k not in buffers and v.is_floating_point() and v.dtype != torch.float32
    ]
    if not lowp:
        return {}
    if not isinstance(opt.get("fp32_groups"), list):
        return {}  # fused optimizer: flat groups without per-parameter shapes; keep the 16-bit weights
    masters = [t for group in opt["fp32_groups"] for t in group]
    found: dict[str, torch.Tensor] = {}
    for master in masters:
        for name in lowp:
            w = module[name]
            if name not in found and w.shape == master.shape and torch.equal(master.to(w.dtype), w):
                found[name] = master
                break
        else:
            return {}
    return found if len(found) == len(lowp) else {}


def _read_module(ckpt: ZeroCheckpoint, dest) -> None:
    meta = ckpt._meta
    module, masters = meta["module"], _stage0_masters(meta, ckpt.shared, set(meta.get("buffer_names") or []))
    for name, t in dest.items():
        _copy(t, masters.get(name, module[name]))


def _read_buffers_and_frozen_z012(ckpt: ZeroCheckpoint, dest) -> None:
    meta = ckpt._meta
    module = meta["module"]
    for k in meta.get("buffer_names") or []:
        if k in dest:
            _copy(dest[k], module[k].float() if module[k].is_floating_point() else module[k])
    for k, frag in (meta.get("frozen_param_fragments") or {}).items():
        if k in dest:
            _copy(dest[k], frag.view(dest[k].shape))


def _read_zero12(ckpt: ZeroCheckpoint, dest) -> None:
    """Stages 1/2: per param group, the ranks' fp32 partitions concatenated form one flat vector in
    which parameters sit back to back (plus optional per-parameter alignment padding)."""
    _read_buffers_and_frozen_z012(ckpt, dest)
    param_shapes = ckpt._meta["param_shapes"]
    paddings = ckpt._meta.get("paddings")
    shards = [load_shard(f, ckpt.trust) for f in ckpt.optim_files]
    groups_per_rank = [s["optimizer_state_dict"]["single_partition_of_fp32_groups"] for s in shards]
    n_groups = len(param_shapes)
    for r, g in enumerate(groups_per_rank):
        if len(g) != n_groups:
            raise CheckpointError(
                f"{ckpt.optim_files[r]} has {len(g)} parameter groups, expected {n_groups}: the shards come from different runs"
            )
    # where each rank's partition starts within each group's full flat vector
    sizes = [[g[i].numel() for g in groups_per_rank] for i in range(n_groups)]
    starts = [[sum(s[:r]) for r in range(len(s))] for s in sizes]
    # parameter offsets within each group's full flat vector
    layout = []  # (group, name, offset, numel)
    for gi, shapes in enumerate(param_shapes):
        offset = 0
        pads = paddings[gi] if paddings is not None else None
        if pads is not None and len(pads) != len(shapes):
            raise CheckpointError(
                f"{ckpt.optim_files[0]} alignment paddings do not match parameter group {gi}: the checkpoint is inconsistent"
            )
        for pi, (name, shape) in enumerate(shapes.items()):
            n = _numel(shape)
            layout.append((gi, name, offset, n))
            offset += n + (pads[pi] if pads is not None else 0)
        align = 2 * ckpt.world_size
        if align * math.ceil(offset / align) != align * math.ceil(sum(sizes[gi]) / align):
            raise CheckpointError(
                f"parameter group {gi} needs {offset} values but the shards in {ckpt.tag_dir} hold {sum(sizes[gi])}: "
                "the shards do not belong together or are corrupt"
            )
    del shards
    for r in range(ckpt.world_size):
        groups = groups_per_rank[r]
        for g in groups:
            _prefetch(g)
        for gi, name, offset, n in layout:
            if name not in dest:
                continue
            lo, hi = starts[gi][r], starts[gi][r] + sizes[gi][r]
            a, b = max(offset, lo), min(offset + n, hi)
            if a < b:
                src = groups[gi][a - lo : b - lo]
                _flat(dest[name])[a - offset : b - offset].copy_(src)
                _drop_pages(src)
        groups_per_rank[r] = None  # drop this rank's mapping before touching the next one
        del groups


def _read_zero3(ckpt: ZeroCheckpoint, dest) -> None:
    """Stage 3: every parameter is split into world_size equal (padded) pieces; rank r's piece of each
    parameter lies back to back in its own flat fp32 groups, in ``param_shapes`` order."""
    ws = ckpt.world_size
    param_shapes = {k: v for g in ckpt._meta.get("param_shapes") or [] for k, v in g.items()}
    module0 = ckpt._meta["module"]
    for k in ckpt._meta.get("buffer_names") or []:
        if k in dest:
            _copy(dest[k], module0[k].float() if module0[k].is_floating_point() else module0[k])
    frozen = ckpt._meta.get("frozen_param_shapes") or {}
    for r in range(ws):
        if frozen:
            meta = ckpt._meta if r == 0 else load_shard(ckpt.model_files[r], ckpt.trust)
            frags = meta.get("frozen_param_fragments") or {}
            for name, shape in frozen.items():
                if name in dest:
                    _copy_piece(dest[name], frags[name].view(-1), r, ws, name, ckpt)
            del meta, frags
        shard = load_shard(ckpt.optim_files[r], ckpt.trust)
        groups = shard["optimizer_state_dict"]["fp32_flat_groups"]
        del shard
        bounds = [0]
        for g in groups:
            bounds.append(bounds[-1] + g.numel())
            _prefetch(g)
        offset = 0
        for name, shape in param_shapes.items():
            piece = math.ceil(_numel(shape) / ws)
            if name in dest:
                src = _read_range(groups, bounds, offset, piece, ckpt, r)
                _copy_piece(dest[name], src, r, ws, name, ckpt)
                if any(
                    src.data_ptr() == g.data_ptr() + (offset - bounds[i]) * g.element_size()
                    for i, g in enumerate(groups)
                ):
                    _drop_pages(src)  # a view into the mapping (not a concatenated copy)
            offset += piece
        if offset != bounds[-1]:
            raise CheckpointError(
                f"{ckpt.optim_files[r]} holds {bounds[-1]} values but the parameters need {offset}: the shards do not belong together or are corrupt"
            )
        del groups


def _read_range(groups, bounds, start, length, ckpt, rank) -> torch.Tensor:
    end = start + length
    if end > bounds[-1]:
        raise CheckpointError(
            f"{ckpt.optim_files[rank]} is shorter than its parameters need: the shard is truncated or from another run"
        )
    pieces = []
    for gi, g in enumerate(groups):
        lo, hi = bounds[gi], bounds[gi + 1]
        a, b = max(start, lo), min(end, hi)
        if a < b:
            pieces.append(g[a - lo : b - lo])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _copy_piece(dst: torch.Tensor, piece: torch.Tensor, rank: int, ws: int, name: str, ckpt) -> None:
    n = dst.numel()
    size = math.ceil(n / ws)
    a, b = rank * size, min(n, (rank + 1) * size)
    if a < b:
        if piece.numel() < b - a:
            raise CheckpointError(
                f"rank {rank}'s piece of {name} in {ckpt.tag_dir} is too short: the shard is corrupt or from another run"
            )
        _flat(dst)[a:b].copy_(piece[: b - a])


def load_fp32_state_dict(tag_dir: str | Path, trust: bool = False) -> dict[str, torch.Tensor]:
    """The full state dict in fp32 (tied names share one tensor), for comparisons and export.

    Non-float buffers keep their stored dtype, as in DeepSpeed's ``zero_to_fp32``.
    """
    ckpt = open_checkpoint(tag_dir, trust)
    module = ckpt._meta["module"]
    sd = {}
    for n, s in ckpt.shapes.items():
        if n in ckpt.shared:
            continue
        stored = module.get(n)
        dtype = stored.dtype if stored is not None and not stored.is_floating_point() else torch.float32
        sd[n] = torch.empty(s, dtype=dtype)
    ckpt.read_into(sd)
    for k, v in ckpt.shared.items():
        sd[k] = sd[v]
    return {n: sd[n] for n in ckpt.shapes}
