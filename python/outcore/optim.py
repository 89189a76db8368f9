"""outcore.optim: outcore's fused CPU Adam/AdamW kernel as a torch.optim.Optimizer.

    from outcore.optim import CPUAdam          # in place of DeepSpeedCPUAdam
    opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.01)   # AdamW (adamw_mode=True)
    loss.backward(); opt.step(); opt.zero_grad()

Parameters (and so their gradients, which torch keeps in the parameter's dtype) are fp32 CPU
tensors, updated in place. The
kernel (AVX-512 or AVX2, chosen at run time by cpuid; outcore._outcore.active_isa() tells which)
runs on a team of oneTBB threads with the GIL released.
"""
import torch

from . import _outcore

__all__ = ["CPUAdam"]

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


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
    amsgrad=True is refused. formula="deepspeed" (default)
    rounds as DeepSpeed's CPU Adam does, "pytorch" as torch.optim.Adam does; both agree with
    torch to about 1e-6 relative. threads: kernel threads (default torch.get_num_threads()).

    step(closure=None, fp16_param_groups=None): fp16_param_groups, as in DeepSpeedCPUAdam, is
    one list per param group of bf16 or fp16 tensors (one per parameter, same numel) that
    receive a rounded copy of each updated parameter in the same pass (a CPU contiguous
    target is written directly; any other, e.g. a CUDA tensor, through a CPU staging copy).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 adamw_mode=True, bias_correction=True, *, amsgrad=False,
                 fp32_optimizer_states=True, formula="deepspeed", threads=None):
        if amsgrad:
            raise ValueError("CPUAdam: amsgrad=True is not supported (as in DeepSpeedCPUAdam)")
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if eps <= 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid beta parameters: {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if formula not in ("deepspeed", "pytorch"):
            raise ValueError(f'formula: got {formula!r}; allowed: "deepspeed", "pytorch"')
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        adamw_mode=adamw_mode, bias_correction=bias_correction)
        super().__init__(params, defaults)
        self.formula = formula
        self._moments = torch.float32 if fp32_optimizer_states else torch.bfloat16
        self._executor = _outcore.Executor(int(threads or torch.get_num_threads()))

    def __setstate__(self, state):
        # load_state_dict() of torch's Adam/AdamW state: their groups lack our keys.
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("adamw_mode", self.defaults["adamw_mode"])
            group.setdefault("bias_correction", self.defaults["bias_correction"])

    @staticmethod
    def _check(p, where, dtype=torch.float32):
        if p.dtype != dtype or p.device.type != "cpu" or not p.is_contiguous():
            kind = "fp32" if dtype == torch.float32 else "bf16"
            raise ValueError(f"CPUAdam: {where} must be a contiguous {kind} CPU tensor, got "
                             f"{p.dtype} on {p.device}"
                             f"{'' if p.is_contiguous() else ' (not contiguous)'}")

    def _state_for(self, p):
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0)
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = torch.zeros_like(p, dtype=self._moments,
                                              memory_format=torch.contiguous_format)
        for key in ("exp_avg", "exp_avg_sq"):
            m = state[key]
            if m.dtype in (torch.float32, torch.bfloat16) and m.dtype != self._moments:
                state[key] = m.to(self._moments)  # a loaded state of the other kind
            self._check(state[key], f"state['{key}'] of a parameter", self._moments)
            if state[key].numel() != p.numel():
                raise ValueError(f"CPUAdam: state['{key}'] has {state[key].numel()} elements, "
                                 f"the parameter {p.numel()}")
        return state

    @staticmethod
    def _copy_target(target, p, gi, pi):
        if target.dtype not in (torch.bfloat16, torch.float16) or target.numel() != p.numel():
            raise ValueError(f"CPUAdam: fp16_param_groups[{gi}][{pi}] must be a bf16 or fp16 "
                             f"tensor of {p.numel()} elements, got {target.dtype} with "
                             f"{target.numel()}")
        if target.device.type == "cpu" and target.is_contiguous():
            return target, None
        return torch.empty(p.numel(), dtype=target.dtype), target

    @torch.no_grad()
    def step(self, closure=None, fp16_param_groups=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if fp16_param_groups is not None and len(fp16_param_groups) != len(self.param_groups):
            raise ValueError(f"CPUAdam: fp16_param_groups has {len(fp16_param_groups)} groups, "
                             f"the optimizer {len(self.param_groups)}")
        for gi, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                grad = p.grad
                self._check(p, f"param_groups[{gi}]['params'][{pi}]")
                if grad.is_sparse:
                    raise ValueError("CPUAdam does not support sparse gradients")
                if (grad.dtype not in _DTYPE_CODES or grad.device.type != "cpu"
                        or grad.numel() != p.numel()):
                    raise ValueError(f"CPUAdam: the grad of param_groups[{gi}]['params'][{pi}] "
                                     f"must be an fp32, bf16 or fp16 CPU tensor of {p.numel()} "
                                     f"elements, got {grad.dtype} on {grad.device} with "
                                     f"{grad.numel()}")
                grad = grad.contiguous()
                state = self._state_for(p)
                step = int(state["step"]) + 1
                out, staged_for = None, None
                if fp16_param_groups is not None:
                    out, staged_for = self._copy_target(fp16_param_groups[gi][pi], p, gi, pi)
                _outcore.adam_step(
                    p.numel(), p.data_ptr(), grad.data_ptr(), _DTYPE_CODES[grad.dtype],
                    state["exp_avg"].data_ptr(), state["exp_avg_sq"].data_ptr(),
                    0 if out is None else out.data_ptr(),
                    0 if out is None else _DTYPE_CODES[out.dtype],
                    float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                    float(group["weight_decay"]), bool(group["adamw_mode"]),
                    bool(group["bias_correction"]), step, self.formula, 1.0, self._executor,
                    _DTYPE_CODES[self._moments])
                if isinstance(state["step"], torch.Tensor):
                    state["step"].fill_(step)
                else:
                    state["step"] = step
                if staged_for is not None:
                    staged_for.view(-1).copy_(out)
        return loss
