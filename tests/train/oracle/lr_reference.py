#!/usr/bin/python3
"""Reference lr / momentum sequences of DeepSpeed's schedulers, written from the formulas
in shared/reference/deepspeed_facts.md section 4, independently of the C++ code.

It mimics how DeepSpeed drives a scheduler: the constructor (last_batch_iteration = -1)
writes lr(-1) into the optimizer's param group; the engine runs an optimizer step with the
group's current lr and then calls scheduler.step() (last_batch_iteration += 1, write
lr(last_batch_iteration)) only when the step was not skipped for an fp16 overflow.

Usage: lr_reference.py SPEC.json
SPEC: [{"name": str, "type": "WarmupLR" | "WarmupDecayLR" | "WarmupCosineLR" | "OneCycle"
        | "constant", "base_lr": float, "params": {...DeepSpeed scheduler params...},
        "steps": int, "skip": [1-based optimizer steps that overflow]}, ...]
Prints {name: {"lr": [lr used by step 1..steps], "beta1": [...] or null,
               "beta2": [...] or null, "last_batch_iteration": final}}.
"""
import json
import math
import sys


class Group:
    def __init__(self, lr):
        self.lr = lr
        self.betas = (0.9, 0.999)


class Warmup:
    """WarmupLR and, with decay=True, WarmupDecayLR."""

    def __init__(self, group, p, decay):
        self.group = group
        self.decay = decay
        self.min_lr = p.get("warmup_min_lr", 0.0)
        default_max = 0.001 if decay else group.lr
        self.max_lr = p.get("warmup_max_lr", default_max)
        self.n = max(2, p.get("warmup_num_steps", 1000))
        self.kind = p.get("warmup_type", "log")
        self.total = p.get("total_num_steps")
        self.i = -1
        self.group.lr = self.lr()

    def gamma(self):
        if self.i < self.n:
            if self.kind == "log":
                return (1.0 / math.log(self.n)) * math.log(self.i + 1)
            return self.i / self.n
        if not self.decay:
            return 1.0
        return max(0.0, float(self.total - self.i) / float(max(1.0, self.total - self.n)))

    def lr(self):
        if self.i < 0:
            return self.min_lr
        return self.min_lr + (self.max_lr - self.min_lr) * self.gamma()

    def step(self):
        self.i += 1
        self.group.lr = self.lr()


class Cosine:
    def __init__(self, group, p):
        self.group = group
        self.org = group.lr
        self.total = p["total_num_steps"]
        self.min_ratio = p.get("warmup_min_ratio", 0.0)
        self.n = max(2, p.get("warmup_num_steps", 1000))
        self.cos_min = p.get("cos_min_ratio", 0.0001)
        self.kind = p.get("warmup_type", "log")
        self.i = -1
        self.group.lr = self.lr()

    def ratio(self):
        if self.i < 0:
            return 0.0
        if self.i < self.n:
            if self.kind == "log":
                r = (1.0 / math.log(self.n)) * math.log(self.i + 1)
            else:
                r = self.i / self.n
            return self.min_ratio + r * (1.0 - self.min_ratio)
        progress = min(1.0, (self.i - self.n + 1) / max(1, self.total - self.n))
        r = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min + (1.0 - self.cos_min) * r)

    def lr(self):
        return 0.0 if self.i < 0 else self.org * self.ratio()

    def step(self):
        self.i += 1
        self.group.lr = self.lr()


class OneCycle:
    def __init__(self, group, p):
        self.group = group
        self.min_lr = p["cycle_min_lr"]
        self.max_lr = p["cycle_max_lr"]
        self.lr_rate = p.get("decay_lr_rate", 0.0)
        self.first = float(p.get("cycle_first_step_size", 2000))
        second = p.get("cycle_second_step_size")
        self.second = float(second) if second is not None else self.first
        self.total = self.first + self.second
        self.ratio = self.first / self.total
        self.stairs1 = p.get("cycle_first_stair_count", 0)
        stairs2 = p.get("cycle_second_stair_count")
        self.stairs2 = self.stairs1 if stairs2 is None else stairs2
        self.decay_size = p.get("decay_step_size", 0)
        self.momentum = p.get("cycle_momentum", True)
        self.min_mom = p.get("cycle_min_mom", 0.8)
        self.max_mom = p.get("cycle_max_mom", 0.9)
        self.mom_rate = p.get("decay_mom_rate", 0.0)
        self.no_lr_decay = self.decay_size == 0 or self.lr_rate == 0
        self.no_mom_decay = self.decay_size == 0 or self.mom_rate == 0
        self.i = -1
        group.lr = self.min_lr
        if self.momentum:
            group.betas = (self.min_mom, 0.99)

    def scale(self):
        b = self.i + 1
        cycle = math.floor(1 + b / self.total)
        x = 1.0 + b / self.total - cycle
        if x <= self.ratio:
            s, stairs = x / self.ratio, self.stairs1
        else:
            s, stairs = (x - 1) / (self.ratio - 1), self.stairs2
        if stairs > 0:
            pos = b % self.total
            if pos <= self.first:
                stair = pos * stairs / self.first
            else:
                stair = (self.total - pos) * stairs / self.second
            s = math.floor(stair) / stairs
        return s

    def step(self):
        self.i += 1
        if self.i < self.total:
            s = self.scale()
            self.group.lr = self.min_lr + (self.max_lr - self.min_lr) * s
            mom = self.max_mom - (self.max_mom - self.min_mom) * s
        else:
            d = self.i - self.total + 1
            if self.no_lr_decay:
                self.group.lr = self.min_lr
            else:
                self.group.lr = self.min_lr / (1 + self.lr_rate * (d / self.decay_size))
            if self.no_mom_decay:
                mom = self.max_mom
            else:
                mom = self.max_mom * (1 + self.mom_rate * (d / self.decay_size))
        if self.momentum:
            self.group.betas = (mom, 0.99)


class Constant:
    def __init__(self, group, p):
        self.group = group
        self.i = -1

    def step(self):
        self.i += 1


def run(case):
    group = Group(case["base_lr"])
    kind, p = case["type"], case.get("params", {})
    if kind == "WarmupLR":
        sched = Warmup(group, p, decay=False)
    elif kind == "WarmupDecayLR":
        sched = Warmup(group, p, decay=True)
    elif kind == "WarmupCosineLR":
        sched = Cosine(group, p)
    elif kind == "OneCycle":
        sched = OneCycle(group, p)
    elif kind == "constant":
        sched = Constant(group, p)
    else:
        raise SystemExit("unknown scheduler type " + kind)
    momentum = kind == "OneCycle" and p.get("cycle_momentum", True)
    skip = set(case.get("skip", []))
    lrs, beta1, beta2 = [], [], []
    for k in range(1, case["steps"] + 1):
        lrs.append(group.lr)  # the optimizer step uses the group's lr
        beta1.append(group.betas[0])
        beta2.append(group.betas[1])
        if k not in skip:
            sched.step()
    return {"lr": lrs, "beta1": beta1 if momentum else None,
            "beta2": beta2 if momentum else None, "last_batch_iteration": sched.i}


def main():
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    json.dump({c["name"]: run(c) for c in cases}, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
