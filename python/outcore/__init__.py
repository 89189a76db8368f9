"""outcore for PyTorch users: the io_uring aio engine, the CPU Adam kernel and the placement
planner of the outcore training engine, without the trainer. The compiled module
outcore._outcore takes addresses, lengths and plain values, never torch objects; the Python
modules check the tensors before handing their memory down.

    import outcore
    h = outcore.aio.Handle()                        # like DeepNVMe's aio_handle
    opt = outcore.optim.CPUAdam(model.parameters())  # like DeepSpeedCPUAdam
    plan = outcore.estimate("ds_config.json", "config.json")

Errors from the engine are raised as the exceptions below, each naming what failed and where
(file and offset for I/O, JSON path for configs):

    outcore.IoError(OSError)               errno, filename, offset, length attributes
    outcore.ConfigError(ValueError)        json_path attribute
    outcore.InvalidArgument(ValueError)    a bad argument (misaligned O_DIRECT request, ...)
    outcore.OutOfMemoryError(MemoryError)
    outcore.Error(RuntimeError)            any other engine error
"""
import json as _json
import os as _os

from . import _args
from . import _outcore
from ._outcore import (ConfigError, CorruptDataError, Error, InvalidArgument, IoError,
                       OutOfMemoryError)
from . import aio
from . import optim

__all__ = ["aio", "optim", "estimate", "Error", "IoError", "ConfigError", "InvalidArgument",
           "OutOfMemoryError", "CorruptDataError"]


_MAX_DEPTH = 256  # JSON nesting, as the C++ parsers allow


def _non_finite(value, at):
    """The JSON path and value of the first NaN or infinity in `value`, or None. Walked without
    recursion; nesting deeper than _MAX_DEPTH raises ValueError naming the path."""
    stack = [(value, at, 0)]
    while stack:
        value, at, depth = stack.pop()
        if isinstance(value, float) and (value != value or value in (float("inf"),
                                                                     float("-inf"))):
            return at, value
        items = value.items() if isinstance(value, dict) else (
            enumerate(value) if isinstance(value, (list, tuple)) else ())
        children = []
        for key, item in items:
            children.append((item, f"{at}[{key}]" if isinstance(key, int) else
                             (f"{at}.{key}" if at else str(key)), depth + 1))
        if children and depth + 1 > _MAX_DEPTH:
            raise ValueError(f"{at or 'the document'}: nested deeper than {_MAX_DEPTH} levels")
        stack.extend(reversed(children))
    return None


def _json_input(value, what):
    """(text_or_path, is_path) for a path (str or os.PathLike) or a dict."""
    if isinstance(value, dict):
        try:
            bad = _non_finite(value, "")
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
        if bad is not None:
            raise ValueError(f"{what}: {bad[0]}: got {bad[1]!r}; JSON has no NaN or infinity: "
                             "give a finite number")
        try:
            return _json.dumps(value, allow_nan=False), False
        except (TypeError, ValueError) as e:  # a value JSON cannot hold (a set, bytes, ...)
            raise TypeError(f"{what}: not a JSON document: {e}") from None
    if isinstance(value, (str, _os.PathLike)):
        # The bytes of the name (a str from os.listdir may hold undecodable bytes as surrogates).
        return _os.fsencode(_args.path(value, what)), True
    raise TypeError(f"{what}: expected a file path or a dict, got {type(value).__name__}")


def estimate(config_path_or_dict, model_config_path_or_dict, world_size=1, *, micro_batch=None,
             seq_len=None, activation_checkpointing=False):
    """The placement plan `outcore estimate` prints, as a dict.

    config_path_or_dict: a DeepSpeed JSON config (path, or the dict json.load gives).
    model_config_path_or_dict: a Hugging Face Llama-family config.json (path or dict).
    world_size: data-parallel ranks. micro_batch / seq_len: default to the config's
    train_micro_batch_size_per_gpu (else 1) / min(max_position_embeddings, 1024); a micro_batch
    given replaces the config's, keeping its gradient_accumulation_steps (where the config sets
    none, it fills it and the accumulation follows from train_batch_size).

    Returns a dict with keys: fits (bool), does_not_fit (the reason, or None), placement
    (stage, param_dtype and the tier of params, optimizer, gradients), peak (bytes per tier:
    device, pinned, host, nvme), items (tier, what, bytes: what makes up each peak),
    per_step (nvme_read, nvme_write, h2d, d2h bytes per optimizer step), budgets, limits (what
    this machine offers each tier), num_parameters, world_size, micro_batches_per_step,
    tokens_per_micro_batch, padded_elems, checkpoint_bytes (one checkpoint's data files), warnings
    (unknown config keys) and table (the text `outcore estimate` prints).

    Raises ConfigError naming the file (or "<config dict>") and JSON path for a bad config,
    IoError for an unreadable file, ValueError for a bad argument (a size out of range, a path
    holding a null byte), TypeError for a size that is not an integer.
    """
    cfg, cfg_is_path = _json_input(config_path_or_dict, "config_path_or_dict")
    model, model_is_path = _json_input(model_config_path_or_dict, "model_config_path_or_dict")
    world_size = _args.integer(world_size, "world_size")
    # 0 asks the core for the default: a 0 given here is refused, as the CLI refuses it.
    micro_batch = 0 if micro_batch is None else _args.integer(micro_batch, "micro_batch", 1,
                                                              2**63 - 1)
    seq_len = 0 if seq_len is None else _args.integer(seq_len, "seq_len", 1, 2**63 - 1)
    if not isinstance(activation_checkpointing, bool):  # "no" would be true
        raise TypeError(f"activation_checkpointing: expected True or False, got "
                        f"{_args.shown(activation_checkpointing)} "
                        f"({type(activation_checkpointing).__name__})")
    return _outcore.estimate(cfg, cfg_is_path, model, model_is_path, world_size, micro_batch,
                             seq_len, activation_checkpointing)
