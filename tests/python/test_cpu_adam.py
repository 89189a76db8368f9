"""outcore.optim.CPUAdam against torch.optim.Adam / AdamW: 20 steps on several parameter groups
with a changing learning rate, within the tolerance tests/cpu_adam/torch_oracle_test.cpp uses;
state_dict round trips (ours and torch's); parameters without a gradient skipped; the bf16/fp16
copy-out; bad input refused (sparse tensors included) by a step that then changes nothing."""
import unittest
import warnings

from oracle import import_torch_and_outcore

torch, outcore = import_torch_and_outcore()
CPUAdam = outcore.optim.CPUAdam

STEPS = 20
SIZES = [(10007,), (33, 65), (1,), (4096,), (7, 3, 5)]  # odd sizes, not vector multiples


def make_params(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.empty(s).uniform_(-1, 1, generator=g)) for s in SIZES]


def make_grads(seed, steps):
    """grads[t][i]: the gradient of parameter i at step t, magnitudes spread over 1e-4..1."""
    g = torch.Generator().manual_seed(seed + 1)
    return [[torch.randn(s, generator=g) * 10 ** torch.empty(s).uniform_(-4, 0, generator=g)
             for s in SIZES] for _ in range(steps)]


def groups_of(params, **extra):
    # Three groups with their own lr and weight decay; the last parameter of the first group
    # gets no gradient on some steps.
    return [dict(params=params[0:2], lr=1e-3, weight_decay=0.1, **extra),
            dict(params=params[2:4], lr=3e-3, weight_decay=0.0, **extra),
            dict(params=params[4:], lr=5e-4, weight_decay=0.01, **extra)]


def run(opt, params, grads, first=0, lr_scale=True, no_grad_on=()):
    for t in range(first, len(grads)):
        for i, p in enumerate(params):
            p.grad = None if (t, i) in no_grad_on else grads[t][i].clone()
        if lr_scale:  # a schedule: lr changes every step
            for k, group in enumerate(opt.param_groups):
                group["lr"] = [1e-3, 3e-3, 5e-4][k] * (1.0 + 0.05 * t)
        opt.step()


def worst_ratio(ours, ref, floor):
    """Worst |ours - ref| / (1e-6 |ref| + floor) (the C++ oracle test's measure); <= 1 passes."""
    err = (ours.double() - ref.double()).abs()
    tol = 1e-6 * ref.double().abs() + floor
    r = err / tol
    return float(torch.where(torch.isnan(r), torch.tensor(float("inf"), dtype=r.dtype), r).max())


def floors(grads, i, lrs_sum):
    gmax = torch.stack([g[i].abs() for g in grads]).max(0).values.double()
    return 1e-6 * lrs_sum, 1e-6 * gmax, 1e-6 * gmax * gmax


class CPUAdamAgainstTorch(unittest.TestCase):
    def compare(self, adamw, formula):
        grads = make_grads(7, STEPS)
        ours_p, ref_p = make_params(3), make_params(3)
        ours = CPUAdam(groups_of(ours_p), adamw_mode=adamw, formula=formula)
        ref_cls = torch.optim.AdamW if adamw else torch.optim.Adam
        ref = ref_cls(groups_of(ref_p), foreach=False)
        no_grad = {(5, 1), (6, 1), (12, 4)}
        run(ours, ours_p, grads, no_grad_on=no_grad)
        run(ref, ref_p, grads, no_grad_on=no_grad)
        for i, (a, b) in enumerate(zip(ours_p, ref_p)):
            k = 0 if i < 2 else 1 if i < 4 else 2
            lrs_sum = sum([1e-3, 3e-3, 5e-4][k] * (1.0 + 0.05 * t) for t in range(STEPS))
            fp, fm, fv = floors(grads, i, lrs_sum)
            sa, sb = ours.state[a], ref.state[b]
            self.assertEqual(float(sa["step"]), float(sb["step"]))
            for name, x, y, fl in (("param", a.detach(), b.detach(), fp),
                                   ("exp_avg", sa["exp_avg"], sb["exp_avg"], fm),
                                   ("exp_avg_sq", sa["exp_avg_sq"], sb["exp_avg_sq"], fv)):
                ratio = worst_ratio(x, y, fl)
                self.assertLessEqual(ratio, 1.0, f"{name} of parameter {i} (adamw={adamw}, "
                                     f"formula={formula}): worst error ratio {ratio:.3g}")

    def test_adamw_matches_torch_adamw(self):
        for formula in ("deepspeed", "pytorch"):
            self.compare(adamw=True, formula=formula)

    def test_adam_l2_matches_torch_adam(self):
        for formula in ("deepspeed", "pytorch"):
            self.compare(adamw=False, formula=formula)

    def test_parameter_without_grad_is_skipped(self):
        params = make_params(5)
        before = params[2].detach().clone()
        opt = CPUAdam(groups_of(params))
        for i, p in enumerate(params):
            p.grad = None if i == 2 else torch.ones_like(p)
        opt.step()
        self.assertTrue(torch.equal(params[2].detach(), before))
        self.assertNotIn(params[2], opt.state)
        self.assertFalse(torch.equal(params[0].detach(), make_params(5)[0].detach()))


class StateDict(unittest.TestCase):
    def test_round_trip_continues_bit_identically(self):
        grads = make_grads(11, STEPS)
        straight_p, resumed_p = make_params(2), make_params(2)
        straight = CPUAdam(groups_of(straight_p))
        run(straight, straight_p, grads)

        first = CPUAdam(groups_of(resumed_p))
        run(first, resumed_p, grads[:10])
        saved = first.state_dict()
        self.assertEqual(sorted(saved["state"][0].keys()), ["exp_avg", "exp_avg_sq", "step"])
        second = CPUAdam(groups_of(resumed_p))
        second.load_state_dict(saved)
        run(second, resumed_p, grads, first=10)
        for a, b in zip(straight_p, resumed_p):
            self.assertTrue(torch.equal(a.detach(), b.detach()))

    def test_a_copy_or_a_pickle_keeps_the_settings_and_steps_on(self):
        import copy
        import io
        grads = make_grads(17, STEPS)
        straight_p = make_params(4)
        straight = CPUAdam(groups_of(straight_p), formula="pytorch", fp32_optimizer_states=False,
                           threads=1)
        run(straight, straight_p, grads)
        for how in ("deepcopy", "torch.save"):
            with self.subTest(how=how):
                params = make_params(4)
                first = CPUAdam(groups_of(params), formula="pytorch",
                                fp32_optimizer_states=False, threads=1)
                run(first, params, grads[:10])
                if how == "deepcopy":
                    params, second = copy.deepcopy((params, first))
                else:
                    buf = io.BytesIO()
                    torch.save((params, first), buf)
                    buf.seek(0)
                    params, second = torch.load(buf)
                self.assertEqual(second.formula, "pytorch")
                run(second, params, grads, first=10)
                for a, b in zip(straight_p, params):
                    self.assertTrue(torch.equal(a.detach(), b.detach()))

    def test_moments_of_another_shape_are_refused(self):
        # The same numbers of elements in another layout: (4, 8) moments for an (8, 4)
        # parameter, as a state saved with the parameters in another order gives.
        a, b = torch.nn.Parameter(torch.ones(4, 8)), torch.nn.Parameter(torch.ones(8, 4))
        first = CPUAdam([a, b])
        a.grad, b.grad = torch.ones(4, 8), torch.ones(8, 4)
        first.step()
        swapped = CPUAdam([b, a])
        swapped.load_state_dict(first.state_dict())
        with self.assertRaisesRegex(ValueError, r"state\['exp_avg'\] of param_groups\[0\]"
                                    r"\['params'\]\[0\] \(shape \(8, 4\)\) has shape \(4, 8\)"):
            swapped.step()

    def test_torch_adamw_state_loads_and_ours_loads_into_torch(self):
        grads = make_grads(13, 12)
        ref_p, ours_p, back_p = make_params(6), make_params(6), make_params(6)
        ref = torch.optim.AdamW(groups_of(ref_p), foreach=False)
        run(ref, ref_p, grads)
        # Ours resumes from torch's state after 6 steps; torch resumes from ours likewise.
        warm = torch.optim.AdamW(groups_of(ours_p), foreach=False)
        run(warm, ours_p, grads[:6])
        ours = CPUAdam(groups_of(ours_p), formula="pytorch")
        ours.load_state_dict(warm.state_dict())
        run(ours, ours_p, grads, first=6)
        warm_ours = CPUAdam(groups_of(back_p), formula="pytorch")
        run(warm_ours, back_p, grads[:6])
        back = torch.optim.AdamW(groups_of(back_p), foreach=False)
        back.load_state_dict(warm_ours.state_dict())
        run(back, back_p, grads, first=6)
        for a, b, c in zip(ref_p, ours_p, back_p):
            self.assertLessEqual(worst_ratio(b.detach(), a.detach(), 1e-6 * 0.05), 1.0)
            self.assertLessEqual(worst_ratio(c.detach(), a.detach(), 1e-6 * 0.05), 1.0)


class CopyOutAndErrors(unittest.TestCase):
    def test_fp16_param_groups_receive_rounded_params(self):
        for dtype in (torch.bfloat16, torch.float16):
            params = make_params(8)
            opt = CPUAdam(groups_of(params))
            for p in params:
                p.grad = torch.full_like(p, 0.5)
            targets = [[torch.zeros(p.numel(), dtype=dtype) for p in g["params"]]
                       for g in opt.param_groups]
            strided = torch.zeros(params[0].numel() * 2, dtype=dtype)[::2]  # via staging
            targets[0][0] = strided
            opt.step(fp16_param_groups=targets)
            flat = [t for g in targets for t in g]
            for p, t in zip(params, flat):
                self.assertTrue(torch.equal(t, p.detach().reshape(-1).to(dtype)))

    def test_bf16_moments_match_torch_with_moments_rounded_each_step(self):
        # fp32_optimizer_states=False: moments kept in bf16. The reference is torch's AdamW in
        # fp32 whose moments are rounded to bf16 after every step; the two differ only where a
        # 1e-6 difference in a moment flips its bf16 rounding, so moments agree within a bf16
        # ulp (2^-8 relative) and parameters within 2^-8 of the summed lr.
        grads = make_grads(9, STEPS)
        ours_p, ref_p = make_params(4), make_params(4)
        ours = CPUAdam(groups_of(ours_p), fp32_optimizer_states=False)
        ref = torch.optim.AdamW(groups_of(ref_p), foreach=False)
        for t in range(STEPS):
            for a, b, g in zip(ours_p, ref_p, grads[t]):
                a.grad, b.grad = g.clone(), g.clone()
            ours.step()
            ref.step()
            for b in ref_p:
                for key in ("exp_avg", "exp_avg_sq"):
                    ref.state[b][key].copy_(ref.state[b][key].bfloat16().float())
        for i, (a, b) in enumerate(zip(ours_p, ref_p)):
            sa, sb = ours.state[a], ref.state[b]
            self.assertEqual(sa["exp_avg"].dtype, torch.bfloat16)
            self.assertEqual(sa["exp_avg_sq"].dtype, torch.bfloat16)
            for key in ("exp_avg", "exp_avg_sq"):
                x, y = sa[key].double(), sb[key].double()
                err = float(((x - y).abs() - 2.0 ** -7 * y.abs()).max())
                self.assertLessEqual(err, 1e-30, f"{key} of parameter {i}")
                # Rounded as the reference rounds: almost every element is the same bf16 value
                # (truncating, or keeping fp32, would differ in about half of them).
                same = float((x == y).double().mean())
                self.assertGreaterEqual(same, 0.98, f"{key} of parameter {i}: {same:.3f} equal")
            lrs_sum = 5e-3 * STEPS
            err = float((a.detach().double() - b.detach().double()).abs().max())
            self.assertLessEqual(err, 2.0 ** -8 * lrs_sum, f"param {i}")
        # The state is half the size and loads into an fp32 optimizer (converted on its step).
        sd = ours.state_dict()
        again = CPUAdam(groups_of(make_params(4)))
        again.load_state_dict(sd)
        for p in again.param_groups[0]["params"]:
            p.grad = torch.zeros_like(p)
        again.step()
        self.assertEqual(again.state[again.param_groups[0]["params"][0]]["exp_avg"].dtype,
                         torch.float32)

    def test_bad_input_is_refused(self):
        p = torch.nn.Parameter(torch.zeros(8, dtype=torch.float64))
        p.grad = torch.zeros(8, dtype=torch.float64)
        with self.assertRaisesRegex(ValueError, "fp32 CPU tensor"):
            CPUAdam([p]).step()
        t = torch.nn.Parameter(torch.zeros(4, 4).t())
        t.grad = torch.zeros(4, 4)
        with self.assertRaisesRegex(ValueError, "not contiguous"):
            CPUAdam([t]).step()
        q = torch.nn.Parameter(torch.zeros(8))
        with self.assertRaises(ValueError):
            CPUAdam([q], amsgrad=True)
        # A flag is a bool: the string "no" (or "False") would be true, None would be false.
        for flag in ("adamw_mode", "bias_correction"):
            for value in ("no", "False", None, 2.0):
                with self.assertRaisesRegex(TypeError, f"{flag} must be True or False"):
                    CPUAdam([q], **{flag: value})
            CPUAdam([q], **{flag: 0})  # as torch takes it
            late = CPUAdam([q])
            late.param_groups[0][flag] = "no"
            q.grad = torch.zeros(8)
            with self.assertRaisesRegex(TypeError, flag):
                late.step()
        for flag in ("fp32_optimizer_states", "amsgrad"):
            for value in ("no", "false", None, 2.0):
                with self.assertRaisesRegex(TypeError, f"{flag} must be True or False"):
                    CPUAdam([q], **{flag: value})
        self.assertEqual(CPUAdam([q], fp32_optimizer_states=0)._moments, torch.bfloat16)
        # NaN is refused where it is given, as torch.optim.Adam refuses it.
        for key in ("lr", "eps", "weight_decay"):
            with self.assertRaisesRegex(ValueError, "Invalid"):
                CPUAdam([q], **{key: float("nan")})
        q.grad = torch.zeros(8)
        opt = CPUAdam([q])
        opt.param_groups[0]["lr"] = float("nan")
        with self.assertRaisesRegex(ValueError, "lr"):
            opt.step()
        # torch options CPUAdam lacks, brought by a torch state_dict, are refused at step(),
        # leaving the parameter as it was (they once ran as plain Adam).
        for key in ("maximize", "amsgrad"):
            torch_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(8))], **{key: True})
            ours = CPUAdam([q])
            ours.load_state_dict(torch_opt.state_dict())
            before = q.detach().clone()
            q.grad = torch.ones(8)
            with self.assertRaisesRegex(ValueError, rf"param_groups\[0\]\['{key}'\] is True"):
                ours.step()
            self.assertTrue(torch.equal(q.detach(), before))
        ours = CPUAdam([q])
        ours.param_groups[0]["betas"] = (0.9,)
        with self.assertRaisesRegex(ValueError, r"\['betas'\] must be a pair"):
            ours.step()

    def test_bad_thread_counts_name_the_argument(self):
        q = torch.nn.Parameter(torch.zeros(8))
        for threads in (-1, 2**32, 257):
            with self.assertRaisesRegex(ValueError, f"threads: got {threads}"):
                CPUAdam([q], threads=threads)
        for threads in (1.5, "2"):
            with self.assertRaisesRegex(TypeError, f"threads: .*{threads!r}"):
                CPUAdam([q], threads=threads)
        self.assertEqual(CPUAdam([q], threads=3)._executor.threads, 3)


def same(a, b):
    """Equal layout, dtype and values (sparse tensors compared densely)."""
    if a.layout != b.layout or a.dtype != b.dtype:
        return False
    if a.layout != torch.strided:
        a, b = a.to_dense(), b.to_dense()
    if a.shape == b.shape and a.is_floating_point():  # NaN where NaN was is unchanged
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def snapshot(opt):
    """Every parameter's bytes and every state entry (by parameter position), copied."""
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {}
    for i, p in enumerate(params):
        if p in opt.state:
            state[i] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                        for k, v in opt.state[p].items()}
    return [p.detach().clone() for p in params], state


class InterruptedStep(unittest.TestCase):
    def test_ctrl_c_during_a_step_leaves_each_update_whole(self):
        # SIGINT sent while step() runs (one large parameter, several small ones): the
        # KeyboardInterrupt comes once the step is over, and every parameter's step count
        # matches its values (each updated once, or the step raised before).
        import os
        import signal
        import threading
        import time
        big = torch.nn.Parameter(torch.ones(1 << 24))
        small = [torch.nn.Parameter(torch.ones(64)) for _ in range(8)]
        for p in [big] + small:
            p.grad = torch.full_like(p, 0.5)
        opt = CPUAdam([big] + small, lr=0.1, threads=1)
        opt.step()
        t0 = time.time()
        opt.step()
        took = time.time() - t0
        reference = CPUAdam([torch.nn.Parameter(torch.ones(64))], lr=0.1)
        reference.param_groups[0]["params"][0].grad = torch.full((64,), 0.5)
        values = [torch.ones(64)]
        for _ in range(6):
            reference.step()
            values.append(reference.param_groups[0]["params"][0].detach().clone())
        interrupted = 0
        for k in range(4):
            timer = threading.Timer(took * (0.2 + 0.2 * k),
                                    lambda: os.kill(os.getpid(), signal.SIGINT))
            timer.start()
            try:
                opt.step()
                time.sleep(took)  # the signal lands after the step: raised here
            except KeyboardInterrupt:
                interrupted += 1
            timer.join()
            for p in [big] + small:  # every element alike: the reference's first
                count = int(float(opt.state[p]["step"]))
                self.assertTrue(torch.equal(p.detach()[:64], values[count]),
                                f"values of step {count}")
            self.assertEqual(float(opt.state[big]["step"]), float(opt.state[small[0]]["step"]))
        self.assertEqual(interrupted, 4)


class AtomicStep(unittest.TestCase):
    """A bad parameter, gradient, state, copy-out target or hyper-parameter late in the list
    makes step() raise before it updates anything."""

    def setUp(self):
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta")

    def make(self, **kw):
        params = make_params(21)
        opt = CPUAdam(groups_of(params), **kw)
        for p in params:
            p.grad = torch.full_like(p, 0.25)
        opt.step()  # every parameter has a state now
        return params, opt

    def assert_raises_and_changes_nothing(self, opt, regex, **step_kw):
        params_before, state_before = snapshot(opt)
        with self.assertRaises(ValueError) as cm:
            opt.step(**step_kw)
        params_after, state_after = snapshot(opt)
        for i, (a, b) in enumerate(zip(params_before, params_after)):
            self.assertTrue(same(a, b), f"parameter {i} changed by a step that raised")
        self.assertEqual(sorted(state_before), sorted(state_after), "states added or removed")
        for i, before in state_before.items():
            after = state_after[i]
            self.assertEqual(sorted(before), sorted(after), f"state keys of parameter {i}")
            for key, v in before.items():
                w = after[key]
                unchanged = same(v, w) if isinstance(v, torch.Tensor) else v == w
                self.assertTrue(unchanged, f"state['{key}'] of parameter {i} changed by a step "
                                "that raised")
        self.assertRegex(str(cm.exception), regex)

    def test_bad_last_parameter(self):
        params, opt = self.make()
        last = opt.param_groups[2]["params"]
        bad = torch.nn.Parameter(torch.zeros(6, dtype=torch.float64))
        bad.grad = torch.zeros(6, dtype=torch.float64)
        last.append(bad)
        self.assert_raises_and_changes_nothing(
            opt, r"param_groups\[2\]\['params'\]\[1\] \(shape \(6,\)\) must be a contiguous "
            "fp32 CPU tensor")

    def test_bad_last_gradient(self):
        params, opt = self.make()
        params[-1].grad.set_(torch.zeros(3))  # the wrong size (torch refuses to assign it)
        self.assert_raises_and_changes_nothing(
            opt, r"grad of param_groups\[2\]\['params'\]\[0\] \(shape \(7, 3, 5\)\)")

    def test_sparse_gradient_late_names_the_parameter(self):
        params, opt = self.make()
        params[-1].grad = torch.zeros(7, 3, 5).to_sparse()
        self.assert_raises_and_changes_nothing(
            opt, r"grad of param_groups\[2\]\['params'\]\[0\] \(shape \(7, 3, 5\)\) is "
            "sparse")

    def test_sparse_parameters_name_the_parameter(self):
        for layout, to in (("sparse_csr", lambda t: t.to_sparse_csr()),
                           ("sparse_coo", lambda t: t.to_sparse())):
            params, opt = self.make()
            bad = torch.nn.Parameter(to(torch.ones(4, 4)))
            bad.grad = to(torch.ones(4, 4))
            opt.param_groups[1]["params"].append(bad)
            self.assert_raises_and_changes_nothing(
                opt, r"param_groups\[1\]\['params'\]\[2\] \(shape \(4, 4\)\) is sparse "
                rf"\(torch.{layout}\)")

    def test_bad_late_state(self):
        for key, bad in (("exp_avg", lambda m: m.double()),
                         ("exp_avg_sq", lambda m: m.to_sparse()),
                         ("exp_avg", lambda m: m[:1]),
                         ("step", lambda s: torch.tensor([1.0, 2.0]))):
            params, opt = self.make()
            state = opt.state[params[-1]]
            state[key] = bad(state[key])
            self.assert_raises_and_changes_nothing(
                opt, rf"state\['{key}'\] of param_groups\[2\]\['params'\]\[0\] "
                r"\(shape \(7, 3, 5\)\)")

    def test_step_counts_beyond_the_kernel_range_change_nothing(self):
        # A count the kernel's integer (and torch's int64 'step') cannot hold once incremented,
        # or that is not a whole number, is refused before the first parameter is updated.
        for bad in (torch.tensor(2.0**70), torch.tensor(2.0**63), 2**64, 2**63 - 1,
                    torch.tensor(float("inf")), torch.tensor(float("nan")), torch.tensor(2.5),
                    2.5, "3", True, torch.tensor(-1.0)):
            params, opt = self.make()
            opt.state[params[-1]]["step"] = bad
            self.assert_raises_and_changes_nothing(
                opt, r"state\['step'\] of param_groups\[2\]\['params'\]\[0\] "
                r"\(shape \(7, 3, 5\)\)")
        params, opt = self.make()  # the largest counts in range still step
        opt.state[params[-1]]["step"] = torch.tensor(2.0**62)
        opt.state[params[0]]["step"] = 2**63 - 2
        opt.step()
        self.assertEqual(float(opt.state[params[-1]]["step"]), 2.0**62)
        self.assertEqual(int(opt.state[params[0]]["step"]), 2**63 - 1)

    def test_moments_sharing_memory(self):
        params, opt = self.make()
        state = opt.state[params[-1]]
        state["exp_avg_sq"] = state["exp_avg"]
        self.assert_raises_and_changes_nothing(opt, "exp_avg and exp_avg_sq share memory")

    def test_bad_late_hyperparameter(self):
        params, opt = self.make()
        opt.param_groups[2]["lr"] = float("nan")
        self.assert_raises_and_changes_nothing(opt, r"param_groups\[2\]: .*lr")
        # eps 0 (refused by the constructor; a group or a loaded state dict can bring it: zero
        # moments over zero made the parameters NaN), a key missing or not a number: ValueErrors
        # naming the group and key, nothing changed.
        for key, value, message in (("eps", 0.0, r"\['eps'\] must be > 0"),
                                    ("lr", None, r"\['lr'\] must be a number, got None"),
                                    ("weight_decay", "x", r"\['weight_decay'\] must be a number"),
                                    ("eps", KeyError, r" has no 'eps'")):
            params, opt = self.make()
            if value is KeyError:
                del opt.param_groups[2][key]
            else:
                opt.param_groups[2][key] = value
            self.assert_raises_and_changes_nothing(opt, rf"param_groups\[2\]{message}")

    def test_bad_late_copy_out_target(self):
        params, opt = self.make()
        targets = [[torch.zeros(p.numel(), dtype=torch.bfloat16) for p in g["params"]]
                   for g in opt.param_groups]
        targets[2][0] = torch.zeros(3, dtype=torch.bfloat16)
        self.assert_raises_and_changes_nothing(opt, r"fp16_param_groups\[2\]\[0\]",
                                               fp16_param_groups=targets)
        targets[2] = []
        self.assert_raises_and_changes_nothing(opt, r"fp16_param_groups\[2\]\[0\] is missing",
                                               fp16_param_groups=targets)
        # An expanded view (one element repeated): its copy-out cannot hold the values.
        targets = [[torch.zeros(p.numel(), dtype=torch.bfloat16) for p in g["params"]]
                   for g in opt.param_groups]
        targets[2][0] = torch.zeros(1, dtype=torch.bfloat16).expand(targets[2][0].numel())
        self.assert_raises_and_changes_nothing(opt, r"fp16_param_groups\[2\]\[0\]: several "
                                               "of its elements share memory",
                                               fp16_param_groups=targets)

    def test_a_new_parameter_failing_gets_no_state(self):
        params = make_params(22)
        opt = CPUAdam(groups_of(params))
        for p in params:
            p.grad = torch.ones_like(p)
        params[-1].grad.set_(torch.ones(2))
        self.assert_raises_and_changes_nothing(opt, "must be an fp32, bf16 or fp16 CPU tensor")
        self.assertEqual(len(opt.state), 0)


if __name__ == "__main__":
    unittest.main()
