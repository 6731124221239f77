"""Fuzz case generators for the optimisers, lr schedules, gradcheck, ``nn.init`` and ``nn.utils`` (the harness: ``fuzz_harness``; the table that
maps public names to generators, and the tests: ``test_fuzz``)."""
from fuzz_harness import *  # noqa: F401,F403 -- Case, the option generators, helpers
from fuzz_modules import module_dtype


# ---------------------------------------------------------------------------- optimisers

def real_options(name, minimum_zero=True):
    options = [("'0.1'", "0.1", True), ("None", None, True), ("True", True, True),
               ("nan", math.nan, minimum_zero), ("10**400", 10**400, True), ("1j", 1j, True),
               ("np.array(0.1)", np.array(0.1), True), ("np.float32(0.1)", np.float32(0.1), False),
               ("Fraction(1, 10)", fractions.Fraction(1, 10), False), ("0", 0, False)]
    if minimum_zero:
        options.append(("-0.1", -0.1, True))
    return options


def gen_optimizer(case, cls):
    dt = case.dtype()
    model = nn.Sequential(nn.Linear(3, 2, dtype=dt, rng=0), nn.LayerNorm(2, dtype=dt))
    params = model.parameters()
    sgd = cls is optim.SGD
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 0.5}]
    case.add("params", params if case.draw(st.booleans(), "groups") else groups, [
        ("None", None, True), ("one Parameter", params[0], True),
        ("an array", params[0].data, True), ("[]", [], True), ("ints", [1, 2], True),
        ("a set", set(params), True), ("a repeated Parameter", [params[0], params[0]], True),
        ("a string", "abc", True), ("a group without params", [{"lr": 0.1}], True),
        ("a group that is not a dict", [groups[0], 3], "param_groups"),
        ("a group with a bad lr", [{"params": params, "lr": -1.0}], "lr"),
        ("a Parameter in two groups", [{"params": params}, {"params": params[:1]}], True),
        ("a generator", (p for p in params), False),
        ("a tuple", tuple(params), False)])
    case.add("lr", case.draw(st.sampled_from([0.1, 0.0, 1e-3]), "lr"), real_options("lr"))
    if sgd:
        case.add("momentum", case.draw(st.sampled_from([0.0, 0.9]), "momentum"),
                 real_options("momentum"))
        case.add("dampening", case.draw(st.sampled_from([0.0, 0.1]), "dampening"),
                 real_options("dampening", minimum_zero=False))
        case.add("weight_decay", case.draw(st.sampled_from([0.0, 0.01]), "wd"),
                 real_options("weight_decay"))
        case.add("nesterov", case.draw(st.booleans(), "nesterov"),
                 [("'yes'", "yes", False), ("False", False, False)])
    else:
        case.add("betas", case.draw(st.sampled_from([(0.9, 0.999), (0.0, 0.5)]), "betas"), [
            ("(0.9,)", (0.9,), True), ("(1.0, 0.9)", (1.0, 0.9), True),
            ("(0.9, -0.1)", (0.9, -0.1), True), ("'ab'", "ab", True), ("None", None, True),
            ("(0.9, 'x')", (0.9, "x"), True), ("(nan, 0.9)", (math.nan, 0.9), True),
            ("an array", np.array([0.9, 0.99]), True), ("(10**400, 0.9)", (10**400, 0.9), True),
            ("[0.9, 0.99]", [0.9, 0.99], False), ("(0, 0)", (0, 0), False)])
        case.add("eps", case.draw(st.sampled_from([1e-8, 0.0]), "eps"), real_options("eps"))
        case.add("weight_decay", case.draw(st.sampled_from([0.0, 0.01]), "wd"),
                 real_options("weight_decay"))
        case.add("amsgrad", case.draw(st.booleans(), "amsgrad"),
                 [("'yes'", "yes", False), ("False", False, False)])
    case.add("maximize", case.draw(st.booleans(), "maximize"), [("1", 1, False)])
    case.mutate()
    if sgd and "nesterov" not in case.bad and case.args["nesterov"] and \
            {"momentum", "dampening"}.isdisjoint(case.bad):
        mu, tau = float(case.args["momentum"]), float(case.args["dampening"])
        if mu <= 0 or tau != 0:
            case.bad.add("nesterov")                     # needs momentum and no dampening
    opt = case.run(cls, lambda o, a: None)
    if opt is None:
        return
    owned = [p for g in opt.param_groups for p in g["params"]]
    assert sorted(map(id, owned)) == sorted(map(id, params)), "param_groups lost a parameter"
    finite = True                                        # no NaN grad so far (state keeps it)
    for step in range(case.draw(st.integers(1, 2), "steps")):
        case.stage()
        for i, param in enumerate(params):
            param.grad = case.array(param.shape, param.dtype, ("normal",) * 5 + ("nan",),
                                    name=f"grad {i}")
        target = params[case.draw(st.integers(0, len(params) - 1), "which grad")]
        grad = target.grad
        case.add("grad", grad, [
            (f"shape {grad.shape + (1,)}", np.zeros(grad.shape + (1,), dt), True),
            ("as int64", grad.astype(np.int64), True), ("the other float dtype",
                                                       grad.astype(other_float(dt)), True),
            ("a ragged list", RAGGED, True), ("a string", "abc", True),
            ("None", None, False), ("a list", grad.tolist(), dt == F32)])
        case.add("closure", None, [("a string", "abc", True), ("a callable", lambda: 1.5, False)],
                 keyword=True)
        case.mutate(most=1)
        target.grad = case.args.pop("grad")
        case.positional.remove("grad")
        before = [p.data.copy() for p in params]
        finite = finite and case.finite

        def check_step(loss, a):
            assert loss == (None if a["closure"] is None else 1.5), "step returns the loss"
            for p, old in zip(params, before):
                expect(p.data, old.shape, dt, "data")
                if finite:
                    assert np.all(np.isfinite(p.data)), "a finite step gave non-finite data"

        if case.run(opt.step, check_step) is None and case.bad:
            target.grad = np.zeros_like(target.data)   # (parameters before it were updated)
    case.stage()
    saved = opt.state_dict()
    fresh = cls([{"params": g["params"]} for g in opt.param_groups],
                **({"lr": 0.1} if sgd else {}))
    bad_state = {"state": {0: {k: np.zeros(7) for k in ("momentum_buffer", "exp_avg",
                                                        "exp_avg_sq")}},
                 "param_groups": saved["param_groups"]}
    case.add("state_dict", saved, [
        ("None", None, True), ("{}", {}, True), ("a list", [], True),
        ("without state", {"param_groups": saved["param_groups"]}, True),
        ("groups not a list", {"state": {}, "param_groups": 3}, True),
        ("state not a dict", {"state": 3, "param_groups": saved["param_groups"]}, True),
        ("a group without params", {"state": {}, "param_groups": [{"lr": 0.1}]}, True),
        ("one group too many", {"state": {}, "param_groups": saved["param_groups"] * 2}, True),
        ("state for a stranger", {"state": {99: {}}, "param_groups": saved["param_groups"]},
         True),
        ("a state of the wrong shape", bad_state, True if sgd or saved["state"] else "state"),
        ("a bad lr", {"state": {}, "param_groups": [dict(g, lr=-1.0) for g in
                                                     saved["param_groups"]]}, "lr")])
    case.mutate(most=1)
    if case.args["state_dict"] is bad_state:
        case.bad = {"state", "state_dict"}
    case.run(fresh.load_state_dict, lambda r, a: None)


# ---------------------------------------------------------------------------- gradcheck

def tanh_backward(dout, x):
    return dout * (1 - np.tanh(x) ** 2)


def gen_gradcheck(case, fn):
    """gradcheck on tiny problems: a right backward passes, a wrong one fails (GradcheckError
    when raise_exception), and every wrong argument is a ValueError/TypeError naming it."""
    shape = case.draw(shapes(max_ndim=2, max_dim=3), "shape")
    problem = case.draw(st.sampled_from(["tanh", "linear", "softmax"]), "problem")
    wrong = case.draw(st.sampled_from([False, False, True]), "wrong backward")
    factor = 2.0 if wrong else 1.0
    x = case.values(shape, F64)
    if problem == "tanh":
        forward, inputs, out_shape = np.tanh, (x,), shape

        def backward(d, x):
            return factor * tanh_backward(d, x)
    elif problem == "linear":
        w = case.values((2, shape[-1] if shape else 1), F64)
        x = x.reshape(shape if shape else (1,))
        forward, inputs, out_shape = npattn.linear, (x, w), x.shape[:-1] + (2,)

        def backward(d, x, w):
            return tuple(factor * g for g in npattn.linear_backward(d, x, w)[:2])
    else:
        forward, inputs, out_shape = npattn.softmax, (x,), shape

        def backward(d, y):
            return factor * npattn.softmax_backward(d, npattn.softmax(y))
    wrong = wrong and math.prod(out_shape) > 0 and all(a.size for a in inputs) and not (
        problem == "softmax" and (not shape or shape[-1] < 2))   # a constant: gradient 0
    case.add("forward", forward, [
        ("3", 3, True), ("a string result", lambda *a: "abc", True),
        ("a None result", lambda *a: None, True),
        ("a random forward", lambda *a: np.random.default_rng().random(out_shape),
         math.prod(out_shape) > 0)])
    case.add("backward", backward, [
        ("too many gradients", lambda d, *a: (None,) * (len(a) + 1), len(inputs) > 0),
        ("a string gradient", lambda d, *a: ("abc",) * len(a), True),
        ("a wrong shape", lambda d, *a: tuple(np.zeros(np.shape(v) + (2,)) for v in a), True),
        ("None gradients", lambda d, *a: (None,) * len(a), False)])
    case.add("inputs", inputs, [("a dict", {"x": x}, True), ("None", None, True),
                                ("an int", 3, True), ("a list", list(inputs), False)])
    case.add("dout", None, [(f"shape {out_shape + (2,)}", np.zeros(out_shape + (2,)), True),
                            ("a string", "abc", True), ("a ragged list", RAGGED, True),
                            ("zeros", np.zeros(out_shape), False),
                            ("float32", np.ones(out_shape, np.float32), False)], keyword=True)
    for name, good in (("eps", 1e-6), ("atol", 1e-5), ("rtol", 1e-3)):
        case.add(name, good, [("-1.0", -1.0, True), ("nan", math.nan, True),
                              ("'x'", "x", True), ("None", None, True),
                              ("np.float32(0.01)", np.float32(0.01), False)], keyword=True)
    case.args["eps"] = 1e-6
    case.options["eps"].append(("0.0", 0.0, True))
    case.add("seed", case.draw(st.integers(0, 99), "seed"),
             [("-1", -1, True), ("'x'", "x", True), ("1.5", 1.5, True), ("None", None, True),
              ("2**64", 2**64, False), ("np.int64(3)", np.int64(3), False)], keyword=True)
    case.add("raise_exception", case.draw(st.booleans(), "raise_exception"), keyword=True)
    case.mutate()
    a = case.args
    shape_problem = case.choice.get("backward") == "a wrong shape"
    if shape_problem and not a["raise_exception"]:
        case.bad.discard("backward")                 # reported (report.ok False), not raised
    wrong = wrong and a["dout"] is None and "backward" not in case.changed and \
        "forward" not in case.changed
    if {"forward", "backward"} & case.changed:
        wrong = False
    case.finite = not (wrong or {"eps", "atol", "rtol", "dout", "backward"} & case.changed)

    def check(report, a):
        assert isinstance(report, gradcheck_module_.GradcheckReport), type(report).__name__
        if case.finite:
            assert report.ok, f"a right backward failed the check:\n{report}"
        if wrong or shape_problem:
            assert not report.ok, "a wrong backward passed"
        str(report), repr(report)

    def call(f):
        try:
            return f(a["forward"], a["backward"], a["inputs"], **{
                k: v for k, v in a.items() if k not in ("forward", "backward", "inputs")})
        except gradcheck_module_.GradcheckError as exc:
            if isinstance(exc, ValueError):
                raise
            assert a["raise_exception"], "GradcheckError without raise_exception"
            assert wrong or not case.finite, f"a right backward failed the check:\n{exc}"
            return None

    result = case.run(fn, lambda r, a: r is None or check(r, a), call=call)
    return result


def gen_gradcheck_module(case, fn):
    dt = case.dtype()
    kind = case.draw(st.sampled_from(["linear", "layer_norm", "embedding"]), "module")
    if kind == "linear":
        module, inputs = nn.Linear(3, 2, dtype=dt, rng=0), (case.values((2, 3), F64),)
    elif kind == "layer_norm":
        module, inputs = nn.LayerNorm(3, dtype=dt), (case.values((2, 3), F64),)
    else:
        module, inputs = nn.Embedding(4, 2, dtype=dt, rng=0), (np.array([0, 3, 3]),)
    case.add("module", module, [("3", 3, True), ("None", None, True), ("a string", "abc", True),
                                ("a function", np.tanh, True)])
    case.add("inputs", inputs, [("a dict", {"x": 1}, True), ("None", None, True)])
    case.add("output", None, [("3", 3, True), ("a string", "x", True),
                              ("the first", lambda r: r, False)], keyword=True)
    case.add("eps", 1e-6, [("0", 0, True), ("'x'", "x", True), ("nan", math.nan, True)],
             keyword=True)
    case.add("seed", 0, [("-1", -1, True), ("'x'", "x", True)], keyword=True)
    case.mutate()
    before = {k: v.copy() for k, v in module.state_dict().items()}

    def check(report, a):
        assert report.ok, f"{kind}: a right module failed the check:\n{report}"
        after = module.state_dict()
        assert all(np.array_equal(after[k], v) for k, v in before.items()), \
            "gradcheck_module changed the caller's module"

    case.run(fn, check, call=lambda f: f(case.args["module"], case.args["inputs"], **{
        k: v for k, v in case.args.items() if k not in ("module", "inputs")}))


# ---------------------------------------------------------------------------- nn.init

INIT_FUNCTIONS = ("uniform", "normal", "constant", "zeros", "ones", "xavier_uniform",
                  "xavier_normal", "kaiming_uniform", "kaiming_normal", "calculate_gain",
                  "fan_in_and_fan_out", "generator", "float_dtype", "size", "float_input")


def gen_init(case, fn):
    """Every initialiser and shared check of nn.init, each argument fuzzed."""
    init = nn.init
    name = case.draw(st.sampled_from(INIT_FUNCTIONS), "function")
    fn = getattr(init, name)
    case.target = f"nn.init.{name}"
    shape = case.draw(shapes(min_ndim=0, max_ndim=3, max_dim=4), "shape")
    needs_2d = name.startswith(("xavier", "kaiming")) or name == "fan_in_and_fan_out"
    if needs_2d and len(shape) < 2:
        shape = shape + (2,) * (2 - len(shape))
    shape_options = [("(-1, 2)", (-1, 2), True), ("(2.0, 2)", (2.0, 2), True),
                     ("'ab'", "ab", True), ("None", None, True), ("(True, 2)", (True, 2), True),
                     ("a list", list(shape), False)]
    if needs_2d:
        shape_options.append(("(3,)", (3,), True))
    real = [("'x'", "x", True), ("None", None, True), ("1j", 1j, True),
            ("10**400", 10**400, True), ("np.float32(0.5)", np.float32(0.5), False)]
    if name in ("uniform", "normal", "constant", "zeros", "ones", "xavier_uniform",
                "xavier_normal", "kaiming_uniform", "kaiming_normal", "fan_in_and_fan_out"):
        case.add("shape", shape, shape_options)
    if name == "uniform":
        case.add("a", -1.0, real)
        case.add("b", 1.0, real)
    if name == "normal":
        case.add("mean", 0.0, real)
        case.add("std", 1.0, real + [("-1.0", -1.0, True), ("nan", math.nan, True)])
    if name == "constant":
        case.add("value", 0.5, real[:-1])
    if name in ("xavier_uniform", "xavier_normal"):
        case.add("gain", 1.0, real + [("-1.0", -1.0, name == "xavier_normal"),
                                      ("inf", math.inf, True)])
    if name in ("kaiming_uniform", "kaiming_normal"):
        case.add("a", math.sqrt(5), [o for o in real if o[0] != "None"] + [("None", None, False)])
        case.add("mode", case.draw(st.sampled_from(["fan_in", "fan_out"]), "mode"),
                 choice_options(["fan_in", "fan_out"]))
        case.add("nonlinearity", "leaky_relu", choice_options(["leaky_relu", "relu", "tanh"]))
    if name in INIT_FUNCTIONS[:9]:
        if name not in ("constant", "zeros", "ones"):
            case.add("rng", 0, rng_options(), keyword=True)
        module_dtype(case)
    if name == "calculate_gain":
        case.add("nonlinearity", case.draw(st.sampled_from(["relu", "leaky_relu", "tanh"]),
                                           "nonlinearity"),
                 choice_options(["relu", "leaky_relu", "linear", "selu"]))
        case.add("param", None, real + [("None", None, False), ("0.2", 0.2, False)])
    if name == "generator":
        case.add("value", 0, rng_options("value"))
    if name == "float_dtype":
        case.add("dtype", np.float32, dtype_options())
    if name == "size":
        case.add("name", "width")
        case.add("value", 3, size_options(3, 1))
        case.add("minimum", 1)
    if name == "float_input":
        dt = case.dtype()
        case.add("name", "x")
        x = case.add("value", case.values(shape, dt))
        case.options["value"] = [(o[0], o[1], "x" if o[2] else False)
                                 for o in float_options(case, x, anchored=True)]
        case.add("dtype", dt)
        case.add("owner", "Test")
    case.mutate()
    if name == "calculate_gain" and case.args["nonlinearity"] != "leaky_relu" and \
            "param" in case.bad:
        case.bad.discard("param")                    # param is read by leaky_relu only
    rename = {"size": "width", "generator": "rng"}      # these name what the caller says
    if name in rename:
        case.bad = {rename[name] if b == "value" else b for b in case.bad}

    def check(result, a):
        if name in INIT_FUNCTIONS[:9]:
            s = a["shape"]
            expect(result, tuple(s), np.dtype(a["dtype"]))
            assert np.all(np.isfinite(result)), "initial values are not finite"
        elif name == "fan_in_and_fan_out":
            s = tuple(a["shape"])
            receptive = math.prod(s[2:])
            assert result == (s[1] * receptive, s[0] * receptive), result

    case.run(fn, check)




# ---------------------------------------------------------------------------- nn.utils

NONFINITE = object()   # what a case returns for the RuntimeError error_if_nonfinite asks for


def gen_clip_grad_norm(case, fn):
    dt = case.dtype()
    params = []
    for i in range(case.draw(st.integers(1, 3), "parameters")):
        shape = case.draw(shapes(max_ndim=2, max_dim=4, min_dim=1), f"shape {i}")
        param = nn.Parameter(np.zeros(shape, dt))
        grad = None if case.draw(st.integers(0, 4), f"grad {i} None") == 0 else case.array(
            shape, dt, ("normal",) * 4 + ("nan", "inf", "huge", "tiny"), name=f"grad {i}")
        # any strides, but writeable: it is scaled in place (a read-only one is refused)
        param.grad = grad if grad is None or grad.flags.writeable else grad.copy()
        if grad is not None and case.draw(st.integers(0, 3), f"grad {i} poisoned") == 0:
            param.grad.flat[0] = case.draw(st.sampled_from([math.nan, math.inf]), "poison")
            case.finite = False
        params.append(param)
    case.add("parameters", params, [
        ("None", None, True), ("an array", np.ones(3), True), ("ints", [1, 2], True),
        ("a string", "abc", True), ("a dict", {"a": params[0]}, True),
        ("a list with an array", params + [np.ones(2)], True),
        ("one Parameter", params[0], False), ("a generator", (p for p in params), False),
        ("[]", [], False), ("a tuple", tuple(params), False)])
    case.add("max_norm", case.draw(st.sampled_from([1.0, 0.0, 1e-3, 1e6, math.inf]),
                                   "max_norm"), real_options("max_norm"))
    case.add("norm_type", case.draw(st.sampled_from([2.0, 1.0, 3.0, math.inf, 0.0]),
                                    "norm_type"),
             [("nan", math.nan, True), ("'fro'", "fro", True), ("None", None, True),
              ("True", True, True), ("10**400", 10**400, True), ("2", 2, False),
              ("np.float32(2)", np.float32(2), False), ("-inf", -math.inf, False)],
             keyword=True)
    case.add("error_if_nonfinite", case.draw(st.booleans(), "error_if_nonfinite"),
             flag_options(), keyword=True)
    case.add("foreach", None, [("True", True, False), ("'yes'", "yes", True),
                               ("1", 1, True)], keyword=True)
    case.mutate()
    before = [None if p.grad is None else p.grad.copy() for p in params]

    def call(fn):
        try:
            return case.call(fn)
        except RuntimeError as exc:
            if "non-finite" not in str(exc):
                raise
            return NONFINITE

    def check(total, a):
        chosen = a["parameters"]
        chosen = [chosen] if isinstance(chosen, nn.Parameter) else params if not isinstance(
            chosen, list) else chosen
        grads = [g for p, g in zip(params, before) if g is not None and any(
            p is q for q in chosen)]
        norm_type = float(a["norm_type"])
        with np.errstate(all="ignore"):
            def norm(v):
                v = np.abs(np.asarray(v, np.float64).reshape(-1))
                if norm_type in (math.inf, -math.inf):
                    return (v.max() if norm_type > 0 else v.min()) if v.size else (
                        0.0 if norm_type > 0 else math.inf)
                if norm_type == 0:
                    return float(np.count_nonzero(v))
                return np.sum(v ** norm_type) ** (1 / norm_type)
            want = norm([norm(g) for g in grads]) if grads else 0.0
        finite = math.isfinite(np.float64(np.asarray(want, dt)))
        if total is NONFINITE:
            assert a["error_if_nonfinite"] and not finite, "a RuntimeError for a finite total"
            for p, g in zip(params, before):
                assert (p.grad is None) if g is None else np.array_equal(p.grad, g, equal_nan=True)
            return
        assert isinstance(total, np.generic), f"total is {type(total).__name__}"
        assert not (a["error_if_nonfinite"] and not finite and grads), "no RuntimeError"
        if finite and grads:
            close(total, want, total.dtype, 0.0, "total")
            coef = min(float(a["max_norm"]) / (want + 1e-6), 1.0)
            for p, g in zip(params, before):
                if g is not None and any(p is q for q in chosen):
                    close(p.grad, np.asarray(g, np.float64) * coef, dt, np.abs(g), "grad")

    case.run(fn, check, call=call)


# ---------------------------------------------------------------------------- lr schedules

def gen_lr_scheduler(case, cls):
    """A schedule on a two-group optimiser, its arguments right or wrong; then steps, each
    lr finite, >= 0 and what the group holds, and a state_dict round trip."""
    model = nn.Sequential(nn.Linear(3, 2, rng=0), nn.LayerNorm(2))
    params = model.parameters()
    opt = optim.AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 0.5}], lr=0.1)
    case.add("optimizer", opt, [("None", None, True), ("a list", [opt], True),
                                ("a model", model, True)])
    if cls is optim.LambdaLR:
        case.add("lr_lambda", lambda t: 0.9 ** t, [
            ("a float", 0.5, True), ("None", None, True), ("three functions",
                                                          [lambda t: 1.0] * 3, True),
            ("a function returning a string", lambda t: "x", True),
            ("two functions", [lambda t: 1.0, lambda t: 1.0 / (1 + t)], False)])
    elif cls is optim.LinearLR:
        case.add("start_factor", case.draw(st.sampled_from([1 / 3, 1e-3, 1.0]), "start"), [
            ("0.0", 0.0, True), ("1.5", 1.5, True), ("nan", math.nan, True),
            ("'0.5'", "0.5", True), ("None", None, True), ("np.float32(0.5)",
                                                          np.float32(0.5), False)])
        case.add("end_factor", 1.0, [("-0.1", -0.1, True), ("2", 2, True), ("0", 0, False)])
        case.add("total_iters", case.draw(st.integers(0, 6), "total_iters"),
                 size_options(5))
    elif cls is optim.CosineAnnealingLR:
        case.add("T_max", case.draw(st.integers(1, 9), "T_max"), size_options(5, 1))
        case.add("eta_min", case.draw(st.sampled_from([0.0, 1e-3]), "eta_min"),
                 real_options("eta_min") + [("inf", math.inf, True)])
    else:
        first = optim.LinearLR(opt, start_factor=0.1, total_iters=3)
        second = optim.CosineAnnealingLR(opt, T_max=5)
        other = optim.LinearLR(optim.SGD(params, lr=0.1))
        case.add("schedulers", [first, second], [
            ("[]", [], True), ("None", None, True), ("a scheduler", first, True),
            ("an int in it", [first, 3], True), ("another optimizer's", [first, other], True),
            ("one", [first], "milestones")])
        case.add("milestones", [3], [("[]", [], "milestones"), ("[1.5]", [1.5], True),
                                     ("[-1]", [-1], True), ("3", 3, True), ("None", None, True),
                                     ("(3,)", (3,), False)])
    case.add("last_epoch", -1, [("-2", -2, True), ("1.0", 1.0, True), ("'0'", "0", True),
                                ("None", None, True), ("np.int64(-1)", np.int64(-1), False)],
             keyword=True)
    case.mutate(most=1)
    if cls is optim.SequentialLR and case.choice.get("schedulers") == "one" and \
            case.choice.get("milestones") == "[]":
        case.bad.discard("milestones")                # one scheduler, no milestone: right
    sched = case.run(cls, lambda s, a: None)
    if sched is None:
        return
    COUNTS[case.target] += 1
    for _ in range(case.draw(st.integers(1, 12), "steps")):
        lrs = sched.get_last_lr()
        assert lrs == [g["lr"] for g in opt.param_groups], "get_last_lr is not the groups' lr"
        assert all(isinstance(lr, float) and math.isfinite(lr) and lr >= 0 for lr in lrs), lrs
        opt.step()
        sched.step()
    state, lrs = sched.state_dict(), [g["lr"] for g in opt.param_groups]
    sched.step()
    want = sched.get_last_lr()
    sched.load_state_dict(state)
    for group, lr in zip(opt.param_groups, lrs):      # (the recursive forms read group lr,
        group["lr"] = lr                              # which the optimiser's state restores)
    sched.step()
    assert sched.get_last_lr() == want, "state_dict did not restore the schedule"
