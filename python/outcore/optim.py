"""outcore.optim: outcore's fused CPU Adam/AdamW kernel as a torch.optim.Optimizer.

    from outcore.optim import CPUAdam          # in place of DeepSpeedCPUAdam
    opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.01)   # AdamW (adamw_mode=True)
    loss.backward(); opt.step(); opt.zero_grad()

Parameters (and so their gradients, which torch keeps in the parameter's dtype) are fp32 CPU
tensors, updated in place. The
kernel (AVX-512 or AVX2, chosen at run time by cpuid; outcore._outcore.active_isa() tells which)
runs on a team of oneTBB threads with the GIL released.
"""
import contextlib
import numbers
import signal
import threading

import torch

from . import _args
from . import _outcore

__all__ = ["CPUAdam"]

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_FP32 = (torch.float32,)
_MOMENT_DTYPES = (torch.float32, torch.bfloat16)  # the other one is converted at the update
_MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
# The largest step count: the kernel takes it as a uint64 and a torch 'step' tensor is filled
# with it as an int64, so a state's count must stay below it to be incremented.
_MAX_STEP = 2**63 - 1
_MAX_THREADS = 256  # cpu_adam::Executor::kMaxThreads


@contextlib.contextmanager
def _interrupt_after():
    """A Ctrl-C during the block is raised at its end: each parameter's update (its values,
    moments and step count) is whole. Python runs signal handlers in the main thread only; a
    handler set outside Python (None) or SIG_IGN / SIG_DFL is left as it is."""
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):
        yield
        return
    received = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            previous(*received[0])


def _check_flag(value, what):
    """A flag is a bool (or an integer, 0 or 1, as torch's optimizers take it): a string such
    as "no" or "False" would be true."""
    if isinstance(value, bool) or (isinstance(value, numbers.Integral) and value in (0, 1)):
        return
    raise TypeError(f"{what} must be True or False, got {value!r}")


def _dense_cpu(t, dtypes):
    """True for a dense (strided), contiguous CPU tensor of one of dtypes."""
    return (isinstance(t, torch.Tensor) and t.layout == torch.strided and t.dtype in dtypes
            and t.device.type == "cpu" and t.is_contiguous())


def _refusal(t, what, dtypes):
    """The ValueError naming `what` for a `t` that _dense_cpu(t, dtypes) refused."""
    kinds = " or ".join(_DTYPE_NAMES[d] for d in dtypes)
    if not isinstance(t, torch.Tensor):
        return ValueError(f"CPUAdam: {what} must be a {kinds} tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        return ValueError(f"CPUAdam: {what} is sparse ({t.layout}); CPUAdam takes only dense "
                          f"(strided) {kinds} CPU tensors")
    return ValueError(f"CPUAdam: {what} must be a contiguous {kinds} CPU tensor, got {t.dtype} "
                      f"on {t.device}{'' if t.is_contiguous() else ' (not contiguous)'}")


def _step_count(step):
    """The whole number a state's 'step' holds (an int, an integral float, or a one-element
    tensor of either), or None for anything else (bool, str, inf, nan, 2.5, ...)."""
    if isinstance(step, torch.Tensor):
        if step.numel() != 1 or step.is_complex() or step.dtype == torch.bool:
            return None
        step = step.item()
    if isinstance(step, bool):
        return None
    if isinstance(step, numbers.Integral):
        return int(step)
    if isinstance(step, numbers.Real) and float(step).is_integer():
        return int(step)
    return None


def _where(p, gi, pi):
    return f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)})"


def _distinct_elements(t):
    """True when no two elements of strided tensor `t` share memory."""
    dims = sorted((abs(st), n) for st, n in zip(t.stride(), t.shape) if n > 1)
    span = 1  # elements covered by the dimensions so far
    for stride, n in dims:
        if stride < span:
            break
        span = stride * n
    else:
        return True  # nested strides: distinct
    if t.numel() > 1 << 24:  # too many to list: taken as shared (the message says so)
        return False
    offsets = torch.zeros((), dtype=torch.int64)
    for stride, n in zip(t.stride(), t.shape):
        offsets = offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * stride
    return torch.unique(offsets.reshape(-1)).numel() == t.numel()


def _overlapping(named):
    """Two names of `named` [(name, tensor)] whose memory overlaps, or None."""
    spans = sorted((t.data_ptr(), t.numel() * t.element_size(), name) for name, t in named)
    for (start, nbytes, a), (next_start, _, b) in zip(spans, spans[1:]):
        if next_start < start + nbytes:
            return a, b
    return None


class CPUAdam(torch.optim.Optimizer):
    """Adam (adamw_mode=False: L2 decay added to the gradient, as torch.optim.Adam) or AdamW
    (adamw_mode=True, the default: decoupled decay, as torch.optim.AdamW) on CPU tensors.

    State per parameter is torch's Adam layout: 'step' (a float tensor), 'exp_avg' and
    'exp_avg_sq' (the parameter's shape; fp32, or bf16 with fp32_optimizer_states=False), so
    state_dict() loads into torch.optim.Adam / AdamW and theirs loads here (their groups get
    this optimizer's adamw_mode and bias_correction; moments of the other dtype are converted
    on the next step). A parameter whose .grad is None is skipped (no state, no step), as
    torch does.

    fp32_optimizer_states=False (DeepSpeedCPUAdam's keyword) keeps the moments in bf16: 4 bytes
    per parameter instead of 8; the step computes in fp32 and rounds them on store (to nearest
    even), the master parameters stay fp32.

    Differences from DeepSpeedCPUAdam: the keyword order is torch's (lr, betas, eps,
    weight_decay, adamw_mode, bias_correction); pass them by name and scripts work with either.
    amsgrad=True is refused. Parameters must be fp32 (the master weights; DeepSpeedCPUAdam also
    steps bf16 or fp16 parameters in place): keep fp32 masters here and receive bf16 or fp16
    copies through step(fp16_param_groups=...). formula="deepspeed" (default)
    rounds as DeepSpeed's CPU Adam does, "pytorch" as torch.optim.Adam does. One step agrees
    with torch to about 1e-6 relative either way; over many steps with weight decay "deepspeed"
    drifts from torch's fp32 run (about 1e-3 relative after 2000 steps at lr 1e-3, weight decay
    0.1: torch rounds 1 - lr * weight_decay to fp32 each step, DeepSpeed does not, and is the
    closer of the two to the exact update), while "pytorch" stays within about 1e-5: choose it
    to follow a torch run. threads: kernel threads, 1..256 (default, and 0:
    torch.get_num_threads(), at most 256).

    A state_dict does not say whether it was Adam's (L2) or AdamW's (decoupled): one loaded here
    keeps this optimizer's adamw_mode; pass adamw_mode=False to continue a torch.optim.Adam
    run with weight decay.

    step(closure=None, fp16_param_groups=None): fp16_param_groups, as in DeepSpeedCPUAdam, is
    one list per param group of bf16 or fp16 tensors (one per parameter, same numel) that
    receive a rounded copy of each updated parameter in the same pass (a CPU contiguous
    target is written directly; any other, e.g. a CUDA tensor, through a CPU staging copy).

    step() checks every parameter that has a gradient, the gradient, the parameter's state,
    its fp16_param_groups target and its group's hyper-parameters before it updates anything:
    a step that raises leaves every parameter and every state (exp_avg, exp_avg_sq, step) as it
    was. Bad input raises ValueError (outcore.InvalidArgument for a hyper-parameter) naming the
    parameter as param_groups[g]['params'][i] with its shape; sparse parameters, gradients and
    states are refused that way too, and so is a state 'step' that is not a whole number in
    0..2**63 - 2 (the kernel's step counts end at 2**63 - 1).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 adamw_mode=True, bias_correction=True, *, amsgrad=False,
                 fp32_optimizer_states=True, formula="deepspeed", threads=None):
        for name, value in (("adamw_mode", adamw_mode), ("bias_correction", bias_correction),
                            ("amsgrad", amsgrad),
                            ("fp32_optimizer_states", fp32_optimizer_states)):
            _check_flag(value, f"CPUAdam: {name}")
        if amsgrad:
            raise ValueError("CPUAdam: amsgrad=True is not supported (as in DeepSpeedCPUAdam)")
        # Written as torch.optim.Adam writes them, so that NaN is refused too.
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not eps > 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if (not isinstance(betas, (tuple, list)) or len(betas) != 2
                or not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0)):
            raise ValueError(f"Invalid beta parameters: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if formula not in ("deepspeed", "pytorch"):
            raise ValueError(f'formula: got {formula!r}; allowed: "deepspeed", "pytorch"')
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        adamw_mode=adamw_mode, bias_correction=bias_correction)
        super().__init__(params, defaults)
        self.formula = formula
        self._moments = torch.float32 if fp32_optimizer_states else torch.bfloat16
        threads = _args.integer(0 if threads is None else threads, "threads", 0,
                                _MAX_THREADS, f"0..{_MAX_THREADS} (0: torch.get_num_threads())")
        self._threads = threads or min(torch.get_num_threads(), _MAX_THREADS)
        self._executor = _outcore.Executor(self._threads)

    def __getstate__(self):
        # Pickled (copy.deepcopy, torch.save of the optimizer) with the settings torch's
        # Optimizer leaves out; the executor is made anew on load.
        state = super().__getstate__()
        state.update(formula=self.formula, _moments=self._moments, _threads=self._threads)
        return state

    def __setstate__(self, state):
        # Unpickling (with the settings above), and load_state_dict() (without them), of torch's
        # Adam/AdamW state too: their groups lack our keys.
        super().__setstate__(state)
        if "_threads" in state:
            self._executor = _outcore.Executor(self._threads)
        for group in self.param_groups:
            group.setdefault("adamw_mode", self.defaults["adamw_mode"])
            group.setdefault("bias_correction", self.defaults["bias_correction"])

    @staticmethod
    def _check_grad(grad, p, gi, pi):
        if grad.layout != torch.strided:
            raise ValueError(f"CPUAdam: the grad of {_where(p, gi, pi)} is sparse "
                             f"({grad.layout}); CPUAdam does not support sparse gradients")
        if (grad.dtype not in _DTYPE_CODES or grad.device.type != "cpu"
                or grad.numel() != p.numel()):
            raise ValueError(f"CPUAdam: the grad of {_where(p, gi, pi)} must be an fp32, bf16 or "
                             f"fp16 CPU tensor of {p.numel()} elements, got {grad.dtype} on "
                             f"{grad.device} with {grad.numel()}")

    @staticmethod
    def _checked_step_count(state, p, gi, pi):
        """The steps p's (non-empty) state has taken, after checking that state."""
        missing = [key for key in ("step",) + _MOMENT_KEYS if key not in state]
        if missing:
            raise ValueError(f"CPUAdam: the state of {_where(p, gi, pi)} lacks {missing}")
        for key in _MOMENT_KEYS:
            m = state[key]
            if not _dense_cpu(m, _MOMENT_DTYPES):
                raise _refusal(m, f"state['{key}'] of {_where(p, gi, pi)}", _MOMENT_DTYPES)
            if m.shape != p.shape:  # as torch's Adam, which fails on another shape
                raise ValueError(f"CPUAdam: state['{key}'] of {_where(p, gi, pi)} has shape "
                                 f"{tuple(m.shape)}")
        count = _step_count(state["step"])
        if count is None:
            raise ValueError(f"CPUAdam: state['step'] of {_where(p, gi, pi)} is not a step "
                             f"count: {_args.shown(state['step'])}")
        if not 0 <= count < _MAX_STEP:
            raise ValueError(f"CPUAdam: state['step'] of {_where(p, gi, pi)} is {count}; "
                             f"allowed: 0..{_MAX_STEP - 1}")
        return count

    @staticmethod
    def _checked_target(targets, p, gi, pi):
        what = f"fp16_param_groups[{gi}][{pi}]"
        if pi >= len(targets):
            raise ValueError(f"CPUAdam: {what} is missing: the group has {len(targets)} targets")
        target = targets[pi]
        if (not isinstance(target, torch.Tensor) or target.layout != torch.strided
                or target.dtype not in (torch.bfloat16, torch.float16)
                or target.numel() != p.numel()):
            got = (f"{target.layout} {target.dtype} with {target.numel()}"
                   if isinstance(target, torch.Tensor) else type(target).__name__)
            raise ValueError(f"CPUAdam: {what} must be a dense bf16 or fp16 tensor of "
                             f"{p.numel()} elements, got {got}")
        if not _distinct_elements(target):  # an expanded view: writing it cannot hold the values
            raise ValueError(f"CPUAdam: {what}: several of its elements share memory (an "
                             "expanded or overlapping view), or may (over 2^24 elements whose "
                             "strides do not nest)")
        if target.is_neg():
            raise ValueError(f"CPUAdam: {what} is a negative view (call .resolve_neg() first)")
        return target

    def _check_overlap(self, p, state, target, gi, pi):
        """ValueError if two arrays the kernel gets for p overlap (it refuses those)."""
        if p.numel() == 0:
            return
        named = [("the parameter", p)]
        if p.grad.is_contiguous():  # else a contiguous copy is made
            named.append(("its grad", p.grad))
        if state:
            named += [(key, state[key]) for key in _MOMENT_KEYS
                      if state[key].dtype == self._moments]  # else a converted copy is made
        if target is not None and target.device.type == "cpu" and target.is_contiguous():
            named.append(("its fp16_param_groups target", target))
        pair = _overlapping(named)
        if pair is not None:
            raise ValueError(f"CPUAdam: {_where(p, gi, pi)}: {pair[0]} and {pair[1]} share "
                             "memory")

    def _checked_updates(self, fp16_param_groups):
        """[(group, p, step, target)] for every parameter step() updates, after checking all of
        them; raises ValueError before anything is changed."""
        if fp16_param_groups is not None and len(fp16_param_groups) != len(self.param_groups):
            raise ValueError(f"CPUAdam: fp16_param_groups has {len(fp16_param_groups)} groups, "
                             f"the optimizer {len(self.param_groups)}")
        updates = []
        for gi, group in enumerate(self.param_groups):
            first = len(updates)
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if not _dense_cpu(p, _FP32):
                    raise _refusal(p, _where(p, gi, pi), _FP32)
                self._check_grad(p.grad, p, gi, pi)
                state = self.state.get(p)  # .get: adds no empty state for p
                step = self._checked_step_count(state, p, gi, pi) + 1 if state else 1
                target = None
                if fp16_param_groups is not None:
                    target = self._checked_target(fp16_param_groups[gi], p, gi, pi)
                self._check_overlap(p, state, target, gi, pi)
                updates.append((group, p, step, target))
            if len(updates) > first:
                self._check_hyperparameters(group, gi)
        return updates

    def _check_hyperparameters(self, group, gi):
        """The kernel's own checks of the group's lr, betas, eps and weight_decay; and no
        torch option the kernel lacks (a torch Adam/AdamW state_dict can bring them)."""
        for key in ("amsgrad", "maximize"):
            if group.get(key, False):
                raise ValueError(f"CPUAdam: param_groups[{gi}]['{key}'] is {group[key]!r}: "
                                 f"CPUAdam has no {key} (torch.optim.Adam and AdamW do)")
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"CPUAdam: param_groups[{gi}]['betas'] must be a pair (beta1, "
                             f"beta2), got {betas!r}")
        beta1, beta2 = betas
        values = {}
        for key in ("lr", "eps", "weight_decay", "adamw_mode", "bias_correction"):
            if key not in group:
                raise ValueError(f"CPUAdam: param_groups[{gi}] has no '{key}'")
            if key in ("adamw_mode", "bias_correction"):
                _check_flag(group[key], f"CPUAdam: param_groups[{gi}]['{key}']")
            try:
                values[key] = (bool if key in ("adamw_mode", "bias_correction") else float)(
                    group[key])
            except (TypeError, ValueError):
                raise ValueError(f"CPUAdam: param_groups[{gi}]['{key}'] must be a number, got "
                                 f"{group[key]!r}") from None
        if not values["eps"] > 0.0:  # as the constructor: eps 0 divides zero moments by zero
            raise ValueError(f"CPUAdam: param_groups[{gi}]['eps'] must be > 0, got "
                             f"{values['eps']}")
        try:
            _outcore.check_adam_params(
                values["lr"], float(beta1), float(beta2), values["eps"], values["weight_decay"],
                values["adamw_mode"], values["bias_correction"], 1, self.formula, 1.0)
        except (TypeError, ValueError) as e:
            raise ValueError(f"CPUAdam: param_groups[{gi}]: {e}") from None

    def _update(self, group, p, step, target):
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0)
            for key in _MOMENT_KEYS:
                state[key] = torch.zeros_like(p, dtype=self._moments,
                                              memory_format=torch.contiguous_format)
        for key in _MOMENT_KEYS:
            if state[key].dtype != self._moments:
                state[key] = state[key].to(self._moments)  # a loaded state of the other kind
        grad = p.grad.contiguous()
        out, staged_for = target, None
        if target is not None and (target.device.type != "cpu" or not target.is_contiguous()):
            out, staged_for = torch.empty(p.numel(), dtype=target.dtype), target
        beta1, beta2 = group["betas"]
        _outcore.adam_step(
            p.numel(), p.data_ptr(), grad.data_ptr(), _DTYPE_CODES[grad.dtype],
            state["exp_avg"].data_ptr(), state["exp_avg_sq"].data_ptr(),
            0 if out is None else out.data_ptr(), 0 if out is None else _DTYPE_CODES[out.dtype],
            float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
            float(group["weight_decay"]), bool(group["adamw_mode"]),
            bool(group["bias_correction"]), step, self.formula, 1.0, self._executor,
            _DTYPE_CODES[self._moments])
        if isinstance(state["step"], torch.Tensor):
            state["step"].fill_(step)
        else:
            state["step"] = step
        if staged_for is not None:
            staged_for.copy_(out.view(staged_for.shape))

    @torch.no_grad()
    def step(self, closure=None, fp16_param_groups=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        updates = list(self._checked_updates(fp16_param_groups))
        with _interrupt_after():
            for update in updates:
                self._update(*update)
        return loss
