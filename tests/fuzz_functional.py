"""Fuzz case generators for the functional ops (``npattn.<op>``) (the harness: ``fuzz_harness``; the table that
maps public names to generators, and the tests: ``test_fuzz``)."""
from fuzz_harness import *  # noqa: F401,F403 -- Case, the option generators, helpers


# ---------------------------------------------------------------------------- functional ops

def gen_linear(case, fn, backward):
    dt = case.dtype()
    lead = case.draw(shapes(max_ndim=3, max_dim=4), "lead")
    fin, fout = case.draw(sizes(), "Fin"), case.draw(sizes(), "Fout")
    case.group = ["x", "weight", "bias", "dout"]
    if backward:
        dout = case.array(lead + (fout,), dt, name="dout")
        case.add("dout", dout, float_options(case, dout, anchored=DTYPE, bad_shapes=[
            lead + (fout + 1,), (1,) + lead + (fout,)]))
    x = case.add("x", case.array(lead + (fin,), dt, name="x"))
    case.options["x"] = float_options(case, x, anchored=DTYPE, bad_shapes=[(), lead + (fin + 1,)])
    w = case.add("weight", case.array((fout, fin), dt, name="weight"))
    case.options["weight"] = float_options(case, w, anchored=DTYPE, bad_shapes=[
        (fout,), (fout, fin + 2), (fout, fin, 1), ()])     # (x's is Fin + 1)
    b = case.array((fout,), dt, name="bias") if case.draw(st.booleans(), "bias") else None
    case.add("bias", b, float_options(case, case.values((fout,), dt), anchored=DTYPE, optional=True,
                                      bad_shapes=[(fout + 1,), (fout, 1), ()]))
    case.mutate()

    def check(result, a):
        x, w, b = f64(a["x"]), f64(a["weight"]), f64(a["bias"])
        dt = dtype_of(a["x"])
        if not backward:
            expect(result, x.shape[:-1] + (w.shape[0],), dt)
            if case.finite:
                scale = np.abs(x) @ np.abs(w).T + (0 if b is None else np.abs(b))
                close(result, reference.linear_forward(x, w, b), dt, scale)
            return
        dx, dw, db = result
        expect(dx, x.shape, dt, "dx")
        expect(dw, w.shape, dt, "dweight")
        if b is None:
            assert db is None, "dbias must be None without a bias"
        else:
            expect(db, b.shape, dt, "dbias")
        if case.finite:
            want = reference.linear_backward(f64(a["dout"]), x, w, b)
            n = max(math.prod(x.shape[:-1]), 1)
            for got, ref, what in zip(result, want, ("dx", "dweight", "dbias")):
                if got is not None:
                    close(got, ref, dt, 20.0 * n * (1 + np.abs(ref).max(initial=0)), what)

    case.run(fn, check)


def gen_matmul(case, fn, backward):
    dt = case.dtype()
    batch_a, batch_b = case.draw(broadcastable_batches(max_ndim=2, max_dim=3), "batches")
    m, k, n = (case.draw(sizes(4), d) for d in "MKN")
    a_1d, b_1d = case.draw(st.booleans(), "a 1-D"), case.draw(st.booleans(), "b 1-D")
    a_shape = (k,) if a_1d else batch_a + (m, k)
    b_shape = (k,) if b_1d else batch_b + (k, n)
    out_shape = np.matmul(np.zeros(a_shape), np.zeros(b_shape)).shape
    case.group = ["a", "b", "dout"]
    if backward:
        dout = case.array(out_shape, dt, name="dout")
        case.add("dout", dout, float_options(case, dout, anchored=DTYPE, bad_shapes=[
            out_shape[:-1] + (out_shape[-1] + 1,) if out_shape else (1,), (2,) + out_shape]))
    a = case.add("a", case.array(a_shape, dt, name="a"))
    b = case.add("b", case.array(b_shape, dt, name="b"))
    bad_a = [(), a_shape[:-1] + (k + 1,)]
    if batch_b and batch_b[-1] != 1 and not a_1d and not b_1d:
        bad_a.append((2 if batch_b[-1] == 0 else batch_b[-1] + 1, m, k))   # cannot broadcast
    case.options["a"] = float_options(case, a, anchored=DTYPE, bad_shapes=bad_a)
    case.options["b"] = float_options(case, b, anchored=DTYPE, bad_shapes=[
        (), (k + 2,) if b_1d else batch_b + (k + 2, n)])   # (+2: a's is +1, never both right)
    case.mutate()

    def check(result, args):
        a, b = f64(args["a"]), f64(args["b"])
        dt = dtype_of(args["a"])
        if not backward:
            expect(result, np.matmul(a, b).shape, dt)
            if case.finite:
                close(result, np.matmul(a, b), dt, np.matmul(np.abs(a), np.abs(b)))
            return
        da, db = result
        expect(da, a.shape, dt, "da")
        expect(db, b.shape, dt, "db")
        if case.finite:
            dout = f64(args["dout"])
            want = reference.matmul_backward(dout, a, b)
            n = max(dout.size, 1)
            for got, ref, what in zip(result, want, ("da", "db")):
                close(got, ref, dt, 20.0 * n * (1 + np.abs(ref).max(initial=0)), what)

    case.run(fn, check)


def gen_softmax(case, fn, log, backward):
    dt = case.dtype()
    shape = case.draw(shapes(max_ndim=3, max_dim=5), "shape")
    if case.draw(st.booleans(), "long rows"):
        shape = shape + (case.draw(st.integers(14, 70), "C"),)
    span = max(len(shape), 1)
    dim = case.draw(st.integers(-span, span - 1), "dim")
    case.group = ["dout", "out"]
    if backward:
        dout = case.array(shape, dt, name="dout")
        out = case.array(shape, dt, name="out")
        if log:                                      # a log-softmax output is <= 0
            out = -np.abs(out)
        case.add("dout", dout, float_options(case, dout, anchored=DTYPE,
                                             bad_shapes=[shape + (1,), (2,) + shape]))
        case.add("out", out, float_options(case, out, anchored=DTYPE, bad_shapes=[shape + (2,)]))
    else:
        x = case.add("x", case.array(shape, dt, name="x"))
        case.options["x"] = float_options(case, x, anchored=False)
    case.add("dim", dim, dim_options(len(shape)), keyword=case.draw(st.booleans(), "dim="))
    case.mutate()

    def check(result, a):
        first = a["out"] if backward else a["x"]
        arr = np.asarray(first)
        expect(result, arr.shape, arr.dtype)
        axis = int(a["dim"]) % span
        if backward:
            if case.finite:
                op = reference.log_softmax_backward if log else reference.softmax_backward
                d, o = np.atleast_1d(f64(a["dout"])), np.atleast_1d(f64(a["out"]))
                want = op(d, o, axis).reshape(arr.shape)
                scale = 20.0 * (1 + np.abs(d).sum(axis, keepdims=True) *
                                np.exp(np.abs(o)).max(initial=1))
                close(result, want, arr.dtype, np.broadcast_to(scale, d.shape).reshape(arr.shape))
            return
        x64 = np.atleast_1d(f64(a["x"]))
        if x64.size == 0:
            return
        want = (reference.log_softmax_forward if log else reference.softmax_forward)(x64, axis)
        scale = 20.0 if not log else 20.0 * (1 + np.abs(x64[np.isfinite(x64)]).max(initial=0))
        close(result, want.reshape(arr.shape), arr.dtype, scale)

    case.run(fn, check)


def gen_dropout(case, fn, backward):
    dt = case.dtype()
    shape = case.draw(shapes(max_ndim=3, max_dim=6), "shape")
    name = "dout" if backward else "x"
    x = case.add(name, case.array(shape, dt, name=name))
    case.options[name] = float_options(case, x, anchored=False)
    p = case.draw(st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.floats(0, 1)), "p")
    case.add("p", p, probability_options(), keyword=case.draw(st.booleans(), "p="))
    case.add("seed", case.draw(st.integers(0, 2**64 - 1), "seed"), seed_options(),
             keyword=case.draw(st.booleans(), "seed="))
    case.add("training", case.draw(st.booleans(), "training"), flag_options(), keyword=True)
    case.mutate()

    def check(result, a):
        x = np.asarray(a[name])
        expect(result, x.shape, x.dtype)
        if not a["training"]:
            assert np.array_equal(result, x, equal_nan=True), "eval mode must return x"
            return
        p = float(a["p"])
        keep = npattn.dropout_mask(x.shape, p, a["seed"])
        close(result, reference.dropout_forward(f64(x), keep, p), x.dtype, 0.0)

    case.run(fn, check)


def gen_dropout_mask(case, fn):
    shape = case.draw(shapes(max_ndim=3, max_dim=6), "shape")
    case.add("shape", shape, [
        ("an int", 5, False), ("a list", list(shape), False),
        ("an int array", np.array(shape, dtype=np.int64), False), ("()", (), False),
        ("(-1,)", (-1,), True), ("(2.0,)", (2.0,), True), ("'ab'", "ab", True),
        ("None", None, True), ("((2,),)", ((2,),), True), ("(True,)", (True,), True),
        ("(2**62, 2**62)", (2**62, 2**62), True), ("a 2-D array", np.ones((2, 2), int), True)])
    case.add("p", case.draw(st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0, 1)), "p"),
             probability_options())
    case.add("seed", case.draw(st.integers(0, 2**64 - 1), "seed"), seed_options())
    case.mutate()

    def check(result, a):
        s = a["shape"]
        want_shape = (s,) if isinstance(s, int) else tuple(int(n) for n in s)
        expect(result, want_shape, np.dtype(np.bool_))
        p = float(a["p"])
        if p == 0:
            assert result.all(), "p = 0 keeps everything"
        if p == 1:
            assert not result.any(), "p = 1 drops everything"
        assert np.array_equal(result, fn(*[a[n] for n in case.positional])), "not deterministic"

    case.run(fn, check)


def mask_shape(case, full):
    """A mask shape that broadcasts to ``full`` without enlarging it: a suffix of it, each dim
    kept or 1."""
    keep = case.draw(st.integers(0, len(full)), "mask ndim")
    return tuple(n if case.draw(st.booleans(), "mask dim kept") else 1
                 for n in full[len(full) - keep:])


def add_scale(case):
    """An attention call's scale (None or a real), drawn and added to case as a keyword."""
    scale = case.draw(st.one_of(st.none(), st.floats(-2, 2)), "scale")
    case.add("scale", scale, [("'2'", "2", True), ("True", True, True), ("1j", 1j, True),
                              ("np.array(1.0)", np.array(1.0), True), ("10**400", 10**400, True),
                              ("None", None, False), ("np.float32(0.5)", np.float32(0.5), False),
                              ("0", 0, False), ("Fraction(1, 2)", fractions.Fraction(1, 2), False)],
             keyword=True)


def attention_options(case):
    """The options every attention call takes -- dropout_p, seed, is_causal, scale,
    causal_alignment, window -- drawn and added to case as keywords."""
    p = case.draw(st.sampled_from([0.0, 0.0, 0.0, 0.3, 1.0]), "dropout_p")
    seed = case.draw(st.integers(0, 2**64 - 1), "seed") if p > 0 or case.draw(
        st.booleans(), "seed given") else None
    case.add("dropout_p", p, probability_options(), keyword=True)
    case.add("seed", seed, seed_options(none_ok=p == 0), keyword=True)
    case.add("is_causal", case.draw(st.booleans(), "is_causal"), flag_options(), keyword=True)
    add_scale(case)
    case.add("causal_alignment", case.draw(st.sampled_from(["top-left", "bottom-right"]), "align"),
             choice_options(["top-left", "bottom-right"]), keyword=True)
    side = st.none() | st.integers(0, 8)
    case.add("window", case.draw(st.none() | st.tuples(side, side), "window"),
             [("(-1, 2)", (-1, 2), True), ("(1, -3)", (1, -3), True), ("3", 3, True),
              ("(1, 2, 3)", (1, 2, 3), True), ("(1.5, 2)", (1.5, 2), True),
              ("(True, 0)", (True, 0), True), ("'(1, 2)'", "(1, 2)", True),
              ("(None, None)", (None, None), False), ("[0, 0]", [0, 0], False),
              ("(np.int64(2), None)", (np.int64(2), None), False),
              ("(10**30, 0)", (10**30, 0), False)], keyword=True)


def softcap_and_sinks(case, heads, dt):
    """softcap (maybe) and sinks (H,) (maybe), drawn and added to case as keywords."""
    case.add("softcap", case.draw(st.none() | st.sampled_from([0.5, 30.0]), "softcap"),
             [("0", 0, True), ("-1.0", -1.0, True), ("nan", math.nan, True),
              ("inf", math.inf, True), ("'1'", "1", True), ("1j", 1j, True),
              ("True", True, True), ("None", None, False), ("np.float32(2)", np.float32(2), False),
              ("3", 3, False)], keyword=True)
    if case.draw(st.booleans(), "sinks"):
        sinks = case.values((heads,), dt)
        case.add("sinks", sinks, float_options(
            case, sinks, anchored=DTYPE, optional=True,
            bad_shapes=[(heads + 1,), (1, heads)]), keyword=True)


def attention_problem(case, sdpa):
    """Valid arguments of scaled_dot_product_attention (``sdpa``) or attention, added to case."""
    dt = case.dtype()
    heads_kind = case.draw(st.sampled_from(["same", "one", "gqa"] if sdpa else ["same", "one"]),
                           "kv heads")
    if heads_kind == "gqa":
        kv_heads = case.draw(st.integers(1, 2), "Hkv")
        heads = kv_heads * case.draw(st.integers(2, 3), "group")
    else:
        heads = case.draw(st.integers(1, 3), "H")
        kv_heads = heads if heads_kind == "same" else 1
    batch_q, batch_k = case.draw(broadcastable_batches(max_ndim=2, max_dim=3), "batches")
    batch_v = batch_k if case.draw(st.booleans(), "value batch = key batch") else batch_q
    try:
        batch = np.broadcast_shapes(batch_q, batch_k, batch_v)
    except ValueError:                          # key and value broadcast only with query's
        batch_v, batch = batch_k, np.broadcast_shapes(batch_q, batch_k)
    length, n_keys, width, vwidth = (case.draw(sizes(), d) for d in ("L", "S", "E", "Ev"))

    def layout(batch_x, h, n, w, name):
        headless = not batch_x and h == 1 and case.draw(st.booleans(), f"{name} 2-D")
        return (n, w) if headless else batch_x + (h, n, w)

    q_shape = layout(batch_q, heads, length, width, "query")
    k_shape = layout(batch_k, kv_heads, n_keys, width, "key")
    v_shape = layout(batch_v, kv_heads, n_keys, vwidth, "value")
    if len(q_shape) == 2 and heads_kind == "gqa":
        q_shape = (heads, length, width)
    case.group = ["query", "key", "value", "attn_mask" if sdpa else "mask", "dout", "output",
                  "logsumexp", "alibi_slopes", "sinks"]
    q = case.add("query", case.array(q_shape, dt, name="query"))
    k = case.add("key", case.array(k_shape, dt, name="key"))
    v = case.add("value", case.array(v_shape, dt, name="value"))
    full = batch + (heads, length, n_keys)
    mask_kind = case.draw(st.sampled_from(["none", "bool", "float"]), "mask")
    mask = None
    if mask_kind != "none":
        m_shape = mask_shape(case, full)
        if mask_kind == "bool":
            mask = lay_out(case.rng.random(m_shape) < 0.7, case.draw(st.sampled_from(LAYOUTS)),
                           case.rng)
        else:
            mask = case.array(m_shape, dt, ("normal", "masked", "masked"), "mask")
    mask_name = "attn_mask" if sdpa else "mask"
    extra_head = (2,) + full
    case.add(mask_name, mask, [
        ("as int64", np.zeros(full, np.int64), True), ("as complex", np.zeros(full, complex), True),
        ("the other float dtype", np.zeros(full, other_float(dt)), DTYPE),
        ("as object", np.zeros(full, object), True), ("a string", "abc", True),
        ("a ragged list", RAGGED, True), ("an object", Malformed(), True),
        (f"shape {full[:-2] + (length + 2, n_keys)}", np.ones(full[:-2] + (length + 2, n_keys),
                                                             bool), True),
        (f"shape {extra_head}", np.ones(extra_head, bool), True), ("None", None, False)] +
        ([("a bool list", np.ones(full[-2:], bool).tolist(), False)] if length * n_keys else []))
    case.options["query"] = float_options(case, q, anchored=DTYPE, bad_shapes=[
        (length * width,), q_shape[:-1] + (width + 1,)])
    bad_k = [(n_keys * width,), k_shape[:-1] + (width + 2,)]    # (query's is E + 1)
    if len(k_shape) > 2:
        bad_k.append(k_shape[:-3] + (heads + 1,) + k_shape[-2:])
    if batch and batch[-1] != 1:
        bad_k.append((2 if batch[-1] == 0 else batch[-1] + 1,) + k_shape[-3:]
                     if len(k_shape) > 2 else (2 if batch[-1] == 0 else batch[-1] + 1,
                                               kv_heads, n_keys, width))
    case.options["key"] = float_options(case, k, anchored=DTYPE, bad_shapes=bad_k)
    bad_v = [(n_keys * vwidth,), v_shape[:-2] + (n_keys + 1, vwidth)]
    if len(v_shape) > 2:
        bad_v.append(v_shape[:-3] + (kv_heads + 1,) + v_shape[-2:])
    case.options["value"] = float_options(case, v, anchored=DTYPE, bad_shapes=bad_v)
    attention_options(case)
    if case.draw(st.booleans(), "alibi"):
        slopes = case.values((heads,), dt)
        case.add("alibi_slopes", slopes, float_options(
            case, slopes, anchored=DTYPE, optional=True,
            bad_shapes=[(heads + 1,), (2, heads + 1)]), keyword=True)
    softcap_and_sinks(case, heads, dt)
    if sdpa:
        case.add("enable_gqa", heads_kind == "gqa" or case.draw(st.booleans(), "enable_gqa"),
                 flag_options(), keyword=True)
    return mask_name


def float_mask(mask):
    return isinstance(mask, np.ndarray) and mask.dtype.kind == "f"


def add_mask_grad(case, mask_name):
    has_float = float_mask(case.args[mask_name])
    case.add("mask_grad", has_float and case.draw(st.booleans(), "mask_grad"),
             [("1", 1, True), ("'True'", "True", True), ("None", None, True),
              ("True", True, not has_float), ("np.bool_(True)", np.bool_(True), not has_float),
              ("False", False, False)], keyword=True)


def attention_fixups(case, mask_name):
    """Arguments that are each right but wrong together, after ``mutate``: the message names
    the one listed here."""
    a = case.args
    p = a["dropout_p"]
    p_valid = "dropout_p" not in case.bad
    if p_valid and a["seed"] is None and float(p) > 0:
        case.bad.add("seed")                             # dropout needs a seed
    if a.get("mask_grad") is True or a.get("mask_grad") is np.True_:
        if not float_mask(a[mask_name]) and mask_name not in case.bad:
            case.bad.add("mask_grad")                    # only a float mask has a gradient
    if "enable_gqa" in a and a["enable_gqa"] is False and "enable_gqa" in case.changed:
        q, k = (np.asarray(a[n]) for n in ("query", "key"))
        if ({"query", "key"}.isdisjoint(case.bad) and q.ndim > 2 and k.ndim > 2 and
                q.shape[-3] != k.shape[-3] and k.shape[-3] != 1):
            case.bad.add("enable_gqa")                   # grouped-query heads need the flag


def attention_reference(a, mask_name):
    """(output, weights, logsumexp, keep) in float64 from the final arguments, as the
    reference computes them; ``keep`` from npattn.dropout_mask (the contract's mask)."""
    q, k, v = f64(a["query"]), f64(a["key"]), f64(a["value"])
    mask = a[mask_name]
    mask = None if mask is None else np.asarray(mask)
    mask = None if mask is None else (mask if mask.dtype == np.bool_ else f64(mask))
    heads = q.shape[-3] if q.ndim > 2 else 1
    batch = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    length, n_keys = q.shape[-2], k.shape[-2]
    p = float(a["dropout_p"])
    keep = None
    if p > 0:
        keep = npattn.dropout_mask((math.prod(batch), heads, length, n_keys), p, a["seed"])
        keep = keep.reshape(batch + (heads, length, n_keys))
    gqa = bool(a.get("enable_gqa", False)) and k.ndim > 2 and v.ndim > 2  # (2-D broadcasts)
    scale = (1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0) if a["scale"] is None \
        else float(a["scale"])                           # E = 0: npattn's scale is 1
    out, lse = reference.scaled_dot_product_attention_forward(
        q, k, v, mask, keep, p, bool(a["is_causal"]), scale, gqa, a["causal_alignment"],
        window(a), alibi(a), softcap(a), sinks(a))
    out_ndim = max(q.ndim, k.ndim, v.ndim)
    shape = (batch + (heads, length, v.shape[-1]))[-out_ndim:]
    return out.reshape(shape), lse.reshape(shape[:-1]), keep, mask, q, k, v, p, gqa, scale


def alibi(a):
    """The ALiBi slopes as the reference takes them: None or a float64 array."""
    return None if a.get("alibi_slopes") is None else f64(a["alibi_slopes"])


def softcap(a):
    return None if a.get("softcap") is None else float(a["softcap"])


def sinks(a):
    return None if a.get("sinks") is None else f64(a["sinks"])


def check_gradients(grads, a, arrays, options, dt, tol, finite):
    """grads in the functional order (dquery, dkey, dvalue[, dsinks][, dmask]): their count,
    shapes and dtype, and, when ``finite``, their values against the reference's backward of
    the float64 arrays (q, k, v, mask) with options (keep, dropout_p, scale, enable_gqa)."""
    q, k, v, mask = arrays
    names = ["dquery", "dkey", "dvalue"] + ["dsinks"] * (a.get("sinks") is not None) + [
        "dmask"] * bool(a["mask_grad"])
    assert len(grads) == len(names), f"{len(grads)} gradients"
    shapes = dict(dquery=q.shape, dkey=k.shape, dvalue=v.shape,
                  dsinks=np.shape(a.get("sinks")), dmask=np.shape(mask))
    for g, what in zip(grads, names):
        expect(g, shapes[what], dt, what)
    if finite:
        keep, p, scale, gqa = options
        want = reference.scaled_dot_product_attention_backward(
            f64(a["dout"]), q, k, v, mask, keep, p, bool(a["is_causal"]), scale, gqa,
            a["causal_alignment"], window(a), alibi(a), softcap(a), sinks(a))
        want = dict(zip(("dquery", "dkey", "dvalue", "dmask", "dsinks"), want))
        big = tol * (1 + np.abs(f64(a["dout"])).max(initial=0)) * max(q.shape[-2], 1) * 10
        for g, what in zip(grads, names):
            close(g, want[what], dt, big, what)


def window(a):
    """The window argument as the reference takes it: None or a (left, right) tuple."""
    return None if a.get("window") is None else tuple(a["window"])


def attention_scale(a, q, k, v):
    scale = abs(float(a["scale"])) if a["scale"] is not None else 1.0 / math.sqrt(
        max(q.shape[-1], 1))
    return 1.0 + np.abs(v).max(initial=0) * (1 + scale * np.abs(q).max(initial=0) *
                                             np.abs(k).max(initial=0) * q.shape[-1])


def gen_sdpa(case, fn, mode):
    """mode: "output" (scaled_dot_product_attention), "forward" (..._forward), "backward"."""
    mask_name = attention_problem(case, sdpa=True)
    if mode == "backward":
        valid = {n: case.args[n] for n in case.args}
        out, lse = npattn.scaled_dot_product_attention_forward(
            valid["query"], valid["key"], valid["value"], valid["attn_mask"],
            valid["dropout_p"], valid["is_causal"], valid["scale"], valid["enable_gqa"],
            seed=valid["seed"], causal_alignment=valid["causal_alignment"],
            window=valid["window"], alibi_slopes=valid.get("alibi_slopes"),
            softcap=valid["softcap"], sinks=valid.get("sinks"))
        dout = case.values(out.shape, out.dtype)
        case.add("dout", dout, float_options(case, dout, anchored=DTYPE,
                                             bad_shapes=[out.shape[:-1] + (out.shape[-1] + 1,)]),
                 keyword=True)
        case.add("output", out, float_options(case, out, anchored=DTYPE,
                                              bad_shapes=[(2,) + out.shape]), keyword=True)
        case.add("logsumexp", lse, float_options(case, lse, anchored=DTYPE,
                                                 bad_shapes=[lse.shape + (1,)]), keyword=True)
        add_mask_grad(case, "attn_mask")
    case.mutate()
    attention_fixups(case, "attn_mask")

    def check(result, a):
        out, lse, keep, mask, q, k, v, p, gqa, scale = attention_reference(a, mask_name)
        dt = dtype_of(a["query"])
        tol = 20.0 * attention_scale(a, q, k, v) * (k.shape[-2] + 1)
        if mode == "output":
            expect(result, out.shape, dt)
            if case.finite:
                close(result, out, dt, tol)
            return
        if mode == "forward":
            got_out, got_lse = result
            expect(got_out, out.shape, dt, "output")
            expect(got_lse, lse.shape, dt, "logsumexp")
            if case.finite:
                close(got_out, out, dt, tol, "output")
                close(got_lse, lse, dt, tol, "logsumexp")
            return
        check_gradients(result, a, (q, k, v, mask), (keep, p, scale, gqa), dt, tol,
                        case.finite)

    consistent = not (case.changed - {"query", "key", "value", "dout", "output", "logsumexp"})
    case.finite = case.finite and consistent      # forward's output is for the drawn arguments
    case.run(fn, check, call=(lambda f: f(**case.args)) if mode == "backward" else None)


def gen_attention(case, fn, backward):
    mask_name = attention_problem(case, sdpa=False)
    if backward:
        dout_shape = attention_reference(case.args, mask_name)[0].shape
        dout = case.values(dout_shape, dtype_of(case.args["query"]))
        case.add("dout", dout, float_options(case, dout, anchored=DTYPE, bad_shapes=[
            dout_shape[:-1] + (dout_shape[-1] + 1,)]), keyword=True)
        add_mask_grad(case, "mask")
    case.mutate()
    attention_fixups(case, "mask")

    def check(result, a):
        out, _, keep, mask, q, k, v, p, _, scale = attention_reference(a, mask_name)
        dt = dtype_of(a["query"])
        tol = 20.0 * attention_scale(a, q, k, v) * (k.shape[-2] + 1)
        if not backward:
            got_out, got_w = result
            expect(got_out, out.shape, dt, "output")
            expect(got_w, out.shape[:-1] + (k.shape[-2],), dt, "weights")
            if case.finite:
                close(got_out, out, dt, tol, "output")
                close(got_out, f64(got_w) @ v, dt, tol, "output = weights · value")
                if p == 0 and a.get("sinks") is None:  # each row sums to 1, or 0 if masked
                    sums = f64(got_w).sum(axis=-1)
                    assert np.all((np.abs(sums - 1) < 1e-3) | (sums == 0)), "weight rows"
            return
        check_gradients(result, a, (q, k, v, mask), (keep, p, scale, False), dt, tol,
                        case.finite)

    case.run(fn, check, call=lambda f: f(**case.args))


def cu_seqlens_options(cu):
    """Replacements for a cu_seqlens (n_seq + 1,) of prefix sums ending at its total."""
    total = int(cu[-1])
    options = [(f"as {dt}", cast(cu, dt), True) for dt in ("float64", "int16", "uint64", "bool")]
    options += [("None", None, True), ("a string", "abc", True), ("2-D", cu[None], True),
                ("empty", np.zeros(0, np.int64), True), ("starting at 1", cu + 1, True),
                ("ending past the total", np.append(cu[:-1], total + 1), True),
                ("a list", cu.tolist(), False), ("as int32", cu.astype(np.int32), False)]
    if len(cu) > 2 and cu[1] > 0:
        options.append(("decreasing", np.concatenate([cu[:1], [total + 1], cu[1:]]), True))
    return options


def gen_varlen(case, fn, mode):
    """scaled_dot_product_attention_varlen (mode "output"), _forward ("forward"), _backward
    ("backward"): 0-4 packed sequences of 0-6 rows and keys, flash-attn's layout."""
    dt = case.dtype()
    heads_kind = case.draw(st.sampled_from(["same", "one", "gqa"]), "kv heads")
    kv_heads = case.draw(st.integers(1, 2), "Hkv") if heads_kind == "gqa" else None
    heads = kv_heads * case.draw(st.integers(2, 3), "group") if kv_heads else case.draw(
        st.integers(1, 3), "H")
    kv_heads = kv_heads or (heads if heads_kind == "same" else 1)
    n_seq = case.draw(st.integers(0, 4), "n_seq")
    lq = [case.draw(st.integers(0, 6), "L_s") for _ in range(n_seq)]
    lk = lq if case.draw(st.booleans(), "S_s = L_s") else [
        case.draw(st.integers(0, 6), "S_s") for _ in range(n_seq)]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n, dtype=np.int64)]).astype(np.int64)
                  for n in (lq, lk))
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    width, vwidth = case.draw(sizes(), "E"), case.draw(sizes(), "Ev")
    case.group = ["query", "key", "value", "dout", "output", "logsumexp", "alibi_slopes",
                  "sinks"]
    q = case.add("query", case.array((tq, heads, width), dt, name="query"))
    k = case.add("key", case.array((tk, kv_heads, width), dt, name="key"))
    v = case.add("value", case.array((tk, kv_heads, vwidth), dt, name="value"))
    case.options["query"] = float_options(case, q, anchored=DTYPE, bad_shapes=[
        (tq * width,), (tq, heads, width + 1), (1, tq, heads, width), (tq + 1, heads, width)])
    case.options["key"] = float_options(case, k, anchored=DTYPE, bad_shapes=[
        (tk, kv_heads, width + 2), (tk, heads + 1, width), (tk + 1, kv_heads, width)])
    case.options["value"] = float_options(case, v, anchored=DTYPE, bad_shapes=[
        (tk + 1, kv_heads, vwidth), (tk, kv_heads + 1, vwidth), (tk * vwidth,)])
    case.add("cu_seqlens_q", cu_q, cu_seqlens_options(cu_q))
    case.add("cu_seqlens_k", cu_k, cu_seqlens_options(cu_k))
    attention_options(case)
    if case.draw(st.booleans(), "alibi"):
        shape = (heads,) if case.draw(st.booleans(), "slopes per head") else (n_seq, heads)
        slopes = case.values(shape, dt)
        case.add("alibi_slopes", slopes, float_options(
            case, slopes, anchored=DTYPE, optional=True,
            bad_shapes=[(heads + 1,), (n_seq + 1, heads)]), keyword=True)
    softcap_and_sinks(case, heads, dt)
    case.add("enable_gqa", heads_kind == "gqa" or case.draw(st.booleans(), "enable_gqa"),
             flag_options(), keyword=True)
    names = ("query", "key", "value", "cu_seqlens_q", "cu_seqlens_k", "dropout_p", "is_causal",
             "scale", "enable_gqa")
    if mode == "backward":
        a = case.args
        out, lse = npattn.scaled_dot_product_attention_varlen_forward(
            *(a[n] for n in names), seed=a["seed"], causal_alignment=a["causal_alignment"],
            window=a["window"], alibi_slopes=a.get("alibi_slopes"), softcap=a["softcap"],
            sinks=a.get("sinks"))
        dout = case.values(out.shape, out.dtype)
        case.add("dout", dout, float_options(case, dout, anchored=DTYPE, bad_shapes=[
            out.shape[:-1] + (out.shape[-1] + 1,)]), keyword=True)
        case.add("output", out, float_options(case, out, anchored=DTYPE,
                                              bad_shapes=[(2,) + out.shape]), keyword=True)
        case.add("logsumexp", lse, float_options(case, lse, anchored=DTYPE,
                                                 bad_shapes=[lse.shape[::-1] + (1,)]),
                 keyword=True)
    case.mutate()
    a = case.args
    if "dropout_p" not in case.bad and a["seed"] is None and float(a["dropout_p"]) > 0:
        case.bad.add("seed")                             # dropout needs a seed
    if (a["enable_gqa"] is False and "enable_gqa" in case.changed and heads != kv_heads
            and kv_heads != 1 and {"query", "key"}.isdisjoint(case.bad)):
        case.bad.add("enable_gqa")                       # grouped-query heads need the flag

    def check(result, a):
        q, k, v = f64(a["query"]), f64(a["key"]), f64(a["value"])
        cq, ck = np.asarray(a["cu_seqlens_q"]), np.asarray(a["cu_seqlens_k"])
        dt = dtype_of(a["query"])
        p = float(a["dropout_p"])
        keep = None if p == 0 else npattn.dropout_mask(
            (q.shape[1] * int(np.dot(np.diff(cq), np.diff(ck))),), p, a["seed"])
        scale = (1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0) if a["scale"] is None \
            else float(a["scale"])                       # E = 0: npattn's scale is 1
        options = (keep, p, bool(a["is_causal"]), scale, bool(a["enable_gqa"]),
                   a["causal_alignment"], window(a), alibi(a), softcap(a), sinks(a))
        out, lse = reference.scaled_dot_product_attention_varlen_forward(q, k, v, cq, ck,
                                                                         *options)
        tol = 20.0 * attention_scale(a, q, k, v) * (k.shape[0] + 1)
        if mode != "backward":
            got_out, got_lse = (result, None) if mode == "output" else result
            expect(got_out, out.shape, dt, "output")
            if got_lse is not None:
                expect(got_lse, lse.shape, dt, "logsumexp")
            if case.finite:
                close(got_out, out, dt, tol, "output")
                if got_lse is not None:
                    close(got_lse, lse, dt, tol, "logsumexp")
            return
        has_sinks = a.get("sinks") is not None
        assert len(result) == 3 + has_sinks, f"{len(result)} gradients"
        for g, x, what in zip(result, (q, k, v, sinks(a)), ("dquery", "dkey", "dvalue",
                                                             "dsinks")):
            expect(g, x.shape, dt, what)
        if case.finite:
            want = reference.scaled_dot_product_attention_varlen_backward(
                f64(a["dout"]), q, k, v, cq, ck, *options)
            big = tol * (1 + np.abs(f64(a["dout"])).max(initial=0)) * max(q.shape[0], 1) * 10
            for g, ref, what in zip(result, want, ("dquery", "dkey", "dvalue", "dsinks")):
                close(g, ref, dt, big, what)

    consistent = not (case.changed - {"query", "key", "value", "dout", "output", "logsumexp"})
    case.finite = case.finite and consistent      # forward's output is for the drawn arguments
    case.run(fn, check, call=lambda f: f(**case.args))


def cache_options(case, cache, bad_shapes):
    """Replacements for a KV cache: it must be a C-contiguous, writeable float ndarray of the
    query's dtype (it is written in place), so a nested list or a read-only or strided array is
    wrong too; a C-contiguous view into a larger buffer is right."""
    options = [(f"as {dt}", cast(cache, dt), True) for dt in BAD_DTYPES]
    options.append(("the other float dtype", cast(cache, other_float(cache.dtype)), DTYPE))
    options += [("a nested list", cache.tolist(), True), ("None", None, True),
                ("a string", "abc", True), ("a ragged list", RAGGED, True),
                ("an object", Malformed(), True)]
    read_only = cache.copy()
    read_only.flags.writeable = False
    fortran, strided = np.asfortranarray(cache), lay_out(cache, "sliced", case.rng)
    buffer = np.zeros(cache.size + 3, cache.dtype)
    view = buffer[1:1 + cache.size].reshape(cache.shape)
    view[...] = cache
    options += [("read-only", read_only, True),
                ("in Fortran order", fortran, not fortran.flags.c_contiguous),
                ("a strided view", strided, not strided.flags.c_contiguous),
                ("a view into a larger buffer", view, False)]
    options += [(f"shape {s}", case.values(s, cache.dtype), True) for s in bad_shapes]
    return options


def gen_kv_cache(case, fn):
    """scaled_dot_product_attention_with_kv_cache. The caches are written in place: each call
    gets copies of them (the harness checks that the caller's arrays are left untouched), which
    must hold exactly the reference's caches afterwards -- the new rows at cache_length, nothing
    else -- and be unchanged when the call raises."""
    dt = case.dtype()
    heads_kind = case.draw(st.sampled_from(["same", "one", "gqa"]), "kv heads")
    if heads_kind == "gqa":
        kv_heads = case.draw(st.integers(1, 2), "Hkv")
        heads = kv_heads * case.draw(st.integers(2, 3), "group")
    else:
        heads = case.draw(st.integers(1, 3), "H")
        kv_heads = heads if heads_kind == "same" else 1
    batch = case.draw(shapes(max_ndim=2, max_dim=3), "batch")
    length, width, vwidth = (case.draw(sizes(), d) for d in ("L", "E", "Ev"))
    new = case.draw(st.booleans(), "new entries")
    room = case.draw(st.one_of(sizes(), st.integers(60, 140)), "room")   # (several chunks)
    capacity = room + (length if new else 0)
    cache_length = case.draw(st.one_of(st.just(room), st.integers(0, room)), "cache_length")
    case.group = ["query", "key_cache", "value_cache", "key", "value"]
    kinds = ("normal",) * 4 + KINDS           # five arrays: ordinary values more often, so
                                              # that some valid calls are checked in full
    def cache(w, name):
        kind = case.draw(st.sampled_from(kinds), f"{name} values")
        if kind != "normal":
            case.finite = False
        values = case.values(batch + (kv_heads, capacity, w), dt, kind)
        values[..., cache_length:, :] = np.nan          # dead positions: never read
        return values

    q_shape = batch + (heads, length, width)
    q = case.add("query", case.array(q_shape, dt, kinds, name="query"))
    case.options["query"] = float_options(case, q, anchored=DTYPE, bad_shapes=[
        (length * width,), q_shape[:-1] + (width + 1,), (2,) + q_shape])
    kc_shape, vc_shape = batch + (kv_heads, capacity, width), batch + (kv_heads, capacity, vwidth)
    kc = case.add("key_cache", cache(width, "key_cache"))
    case.options["key_cache"] = cache_options(case, kc, [
        kc_shape[:-1] + (width + 1,), kc_shape[:-2] + (capacity + 1, width),
        kc_shape[:-3] + (kv_heads + 1, capacity, width), (2,) + kc_shape, kc_shape[1:]])
    vc = case.add("value_cache", cache(vwidth, "value_cache"))
    case.options["value_cache"] = cache_options(case, vc, [
        vc_shape[:-2] + (capacity + 1, vwidth), vc_shape[:-3] + (kv_heads + 1, capacity, vwidth),
        (2,) + vc_shape])
    case.add("cache_length", cache_length, [
        ("-1", -1, True), ("Smax + 1", capacity + 1, True), ("room + 1", room + 1, False),
        ("1.0", 1.0, True), ("True", True, True), ("np.bool_(False)", np.bool_(False), True),
        ("'0'", "0", True), ("None", None, True), ("10**30", 10**30, True),
        ("np.float64(1)", np.float64(1), True), ("a NumPy int", np.int64(cache_length), False),
        ("np.uint8(0)", np.uint8(0), False), ("0", 0, False), ("room", room, False)])
    # (an int is right or wrong by the final key, value and caches: kv_cache_fixups decides)
    keyword = case.draw(st.booleans(), "key and value by keyword")
    k_shape, v_shape = batch + (kv_heads, length, width), batch + (kv_heads, length, vwidth)
    if new:
        k = case.add("key", case.array(k_shape, dt, kinds, name="key"), keyword=keyword)
        v = case.add("value", case.array(v_shape, dt, kinds, name="value"), keyword=keyword)
        case.options["key"] = float_options(case, k, anchored=DTYPE, bad_shapes=[
            k_shape[:-2] + (length + 1, width), k_shape[:-1] + (width + 1,),
            k_shape[:-3] + (kv_heads + 1, length, width)])
        case.options["value"] = float_options(case, v, anchored=DTYPE, bad_shapes=[
            v_shape[:-1] + (vwidth + 1,), v_shape[:-2] + (length + 1, vwidth)])
    else:                                # an array for one alone is wrong, for both right
        case.add("key", None, [("an array", case.values(k_shape, dt), True)], keyword=keyword)
        case.add("value", None, [("an array", case.values(v_shape, dt), True)],
                 keyword=keyword)
    case.add("is_causal", case.draw(st.booleans(), "is_causal"), flag_options(), keyword=True)
    add_scale(case)
    case.add("enable_gqa", heads_kind == "gqa" or case.draw(st.booleans(), "enable_gqa"),
             flag_options(), keyword=True)
    case.mutate()
    kv_cache_fixups(case, heads, kv_heads, length)

    def call(f):
        args = dict(case.args)
        for name in ("key_cache", "value_cache"):      # a copy the op may write into
            c = args[name]
            if isinstance(c, np.ndarray) and c.flags.c_contiguous and c.flags.writeable:
                args[name] = c.copy()
        before = {n: args[n].copy() for n in ("key_cache", "value_cache")
                  if isinstance(args[n], np.ndarray) and args[n].dtype.kind in "biufc"}
        pos = [args[n] for n in case.positional]
        try:
            result = f(*pos, **{n: v for n, v in args.items() if n not in case.positional})
        except (ValueError, TypeError):
            for n, old in before.items():
                assert np.array_equal(args[n], old, equal_nan=True), \
                    f"{n} written by a call that raised"
            raise
        return result, args["key_cache"], args["value_cache"]

    def check(result, a):
        (out, lse), kc_after, vc_after = result
        q, key, value = f64(a["query"]), a["key"], a["value"]
        dt = dtype_of(a["query"])
        kc, vc = a["key_cache"], a["value_cache"]
        cl = int(a["cache_length"])
        n = cl + (0 if key is None else q.shape[-2])
        expect(out, q.shape[:-1] + (vc.shape[-1],), dt, "output")
        expect(lse, q.shape[:-1], dt, "logsumexp")
        want_kc, want_vc = kc.copy(), vc.copy()         # exactly: the new rows, nothing else
        if key is not None:
            want_kc[..., cl:n, :] = np.asarray(key)
            want_vc[..., cl:n, :] = np.asarray(value)
        for got, want, what in ((kc_after, want_kc, "key_cache"), (vc_after, want_vc,
                                                                  "value_cache")):
            expect(got, want.shape, dt, what)
            assert got.tobytes() == want.tobytes(), f"{what} after the call is not the " \
                "reference's: the new rows at cache_length, the rest unchanged"
        if case.finite:
            scale = (1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0) \
                if a["scale"] is None else float(a["scale"])   # E = 0: npattn's scale is 1
            want_out, want_lse, kc1, vc1 = reference.scaled_dot_product_attention_with_kv_cache(
                q, f64(kc), f64(vc), cl, f64(key), f64(value), bool(a["is_causal"]), scale,
                bool(a["enable_gqa"]))                 # (kc1, vc1: the caches after the write)
            tol = 20.0 * attention_scale(a, q, kc1[..., :n, :], vc1[..., :n, :]) * (n + 1)
            close(out, want_out, dt, tol, "output")
            close(lse, want_lse, dt, tol, "logsumexp")

    case.run(fn, check, call=call)


def kv_cache_fixups(case, heads, kv_heads, length):
    """After ``mutate``: key and value are right when both or neither are given, cache_length
    when it fits the final caches, enable_gqa=False when the heads need no grouping."""
    a = case.args
    if (a["key"] is None) == (a["value"] is None):
        for name in ("key", "value"):
            if case.choice.get(name) in ("None", "an array"):
                case.bad.discard(name)
    cl, kc = a["cache_length"], a["key_cache"]
    if (isinstance(cl, (int, np.integer)) and not isinstance(cl, (bool, np.bool_))
            and isinstance(kc, np.ndarray) and kc.ndim >= 3):
        new = 0 if a["key"] is None or a["value"] is None else length
        if not 0 <= int(cl) <= kc.shape[-2] - new:
            case.bad.add("cache_length")
    gqa = a["enable_gqa"]
    if (isinstance(gqa, (bool, np.bool_)) and not gqa and heads != kv_heads and kv_heads != 1
            and heads % kv_heads == 0):
        case.bad.add("enable_gqa")


def gen_embedding(case, fn, backward):
    dt = case.dtype()
    n_rows, width = case.draw(dims(6), "V"), case.draw(dims(4), "E")
    case.group = ["weight", "dout"]
    shape = case.draw(shapes(max_ndim=3, max_dim=4), "indices shape")
    if n_rows == 0:
        shape = shape[:-1] + (0,) if shape else (0,)
    indices = case.rng.integers(0, max(n_rows, 1), size=shape)
    if backward:
        dout = case.array(shape + (width,), dt, name="dout")
        case.add("dout", dout, float_options(case, dout, anchored=DTYPE, bad_shapes=[
            shape + (width + 1,), shape]))
    case.add("indices", indices, index_options(case, indices, stop=n_rows,
                                               bad_shapes=[(2,) + shape] if backward else []))
    weight = case.add("weight", case.array((n_rows, width), dt, name="weight"))
    case.options["weight"] = float_options(case, weight, anchored=DTYPE if backward else False,
                                           bad_shapes=[(n_rows,), (n_rows, width, 1)])
    pad = case.draw(st.one_of(st.none(), st.integers(-n_rows, n_rows - 1)) if n_rows else
                    st.none(), "padding_idx")
    case.add("padding_idx", pad, [("V", n_rows, True), ("-V - 1", -n_rows - 1, True),
                                  ("1.0", 1.0, True), ("'0'", "0", True), ("True", True, True),
                                  ("None", None, False)] +
             ([("np.int32(0)", np.int32(0), False)] if n_rows else []))
    case.mutate()

    def check(result, a):
        w = f64(a["weight"])
        idx = np.asarray(a["indices"])
        dt = dtype_of(a["weight"])
        if not backward:
            expect(result, idx.shape + (w.shape[1],), dt)
            close(result, w[idx], dt, 0.0)
            return
        expect(result, w.shape, dt)
        if case.finite:
            pad = a["padding_idx"]
            want = reference.embedding_backward(f64(a["dout"]), idx, w,
                                                None if pad is None else int(pad))
            close(result, want, dt, 10.0 * max(idx.size, 1))

    case.run(fn, check)


def gen_cross_entropy(case, fn, backward):
    dt = case.dtype()
    rank = case.draw(st.sampled_from([1, 2, 2, 3]), "input ndim")
    case.group = ["input", "dout"]
    classes = case.draw(dims(5), "C")
    n = case.draw(dims(4), "N")
    extra = case.draw(shapes(max_ndim=1, max_dim=3), "d") if rank == 3 else ()
    in_shape = (classes,) if rank == 1 else (n, classes) + extra
    t_shape = () if rank == 1 else (n,) + extra
    ignore = case.draw(st.sampled_from([-100, -1, 0, 2**63 - 1]), "ignore_index")
    target = case.rng.integers(0, max(classes, 1), size=t_shape)
    if classes == 0 or case.draw(st.booleans(), "some ignored"):
        target = np.where(case.rng.random(t_shape) < (1.0 if classes == 0 else 0.3), ignore,
                          target)
    target = np.asarray(target)
    if backward:
        reduction_default = case.draw(st.sampled_from(["mean", "sum", "none"]), "reduction")
        d_shape = t_shape if reduction_default == "none" else ()
        dout = case.array(d_shape, dt, name="dout")
        case.add("dout", dout, float_options(case, dout, anchored=DTYPE, bad_shapes=[
            d_shape + (2,)]))
    x = case.add("input", case.array(in_shape, dt, name="input"))
    case.options["input"] = float_options(case, x, anchored=DTYPE if backward else False,
                                          bad_shapes=[()])
    case.add("target", target, index_options(case, target, stop=classes, allowed=ignore,
                                             bad_shapes=[t_shape + (2,)]) +
             [("floats", target.astype(float), True)])
    case.add("ignore_index", ignore, [("2**63", 2**63, True), ("-2**63 - 1", -2**63 - 1, True),
                                      ("1.0", 1.0, True), ("'x'", "x", True), ("True", True, True),
                                      ("None", None, True)], keyword=True)
    reduction = reduction_default if backward else case.draw(
        st.sampled_from(["mean", "sum", "none"]), "reduction")
    case.add("reduction", reduction, [o for o in choice_options(["mean", "sum", "none"])
                                      if not backward or not o[1] in ("mean", "sum", "none")
                                      or o[1] == reduction], keyword=True)
    case.add("label_smoothing", case.draw(st.sampled_from([0.0, 0.0, 0.1, 1.0]), "smoothing"),
             probability_options(), keyword=True)
    case.mutate()

    def check(result, a):
        x = f64(a["input"])
        t = np.asarray(a["target"])
        dt = dtype_of(a["input"])
        ref_args = (x, t.astype(np.int64), int(a["ignore_index"]), a["reduction"],
                    float(a["label_smoothing"]))
        if not backward:
            expect(result, t.shape if a["reduction"] == "none" else (), dt)
            if case.finite:
                close(result, reference.cross_entropy_forward(*ref_args), dt,
                      20.0 * (1 + np.abs(x).max(initial=0)) * max(t.size, 1))
            return
        expect(result, x.shape, dt)
        if case.finite:
            close(result, reference.cross_entropy_backward(f64(a["dout"]), *ref_args), dt,
                  20.0 * (1 + np.abs(f64(a["dout"])).max(initial=0)))

    case.run(fn, check)


def gen_layer_norm(case, fn, backward):
    dt = case.dtype()
    norm = case.draw(shapes(min_ndim=1, max_ndim=2, max_dim=5), "normalized_shape")
    lead = case.draw(shapes(max_ndim=2, max_dim=4), "lead")
    case.group = ["x", "weight", "bias", "dout"]
    shape = lead + norm
    if backward:
        dout = case.array(shape, dt, name="dout")
        case.add("dout", dout, float_options(case, dout, anchored=DTYPE,
                                             bad_shapes=[shape + (1,), (2,) + shape]))
    x = case.add("x", case.array(shape, dt, name="x"))
    case.options["x"] = float_options(case, x, anchored=DTYPE, bad_shapes=[
        lead + norm[:-1] + (norm[-1] + 1,)])
    ns = norm if case.draw(st.booleans(), "ns tuple") or len(norm) > 1 else norm[0]
    case.add("normalized_shape", ns, [
        ("()", (), True), ("a negative dim", (-1,), True), ("2.0", 2.0, True),
        ("'3'", "3", True), ("None", None, True), ("True", True, True),
        ("a mismatch", norm[:-1] + (norm[-1] + 2,), True), ("(2.0,)", (2.0,), True),
        ("a list", list(norm), False), ("np ints", tuple(np.int64(n) for n in norm), False),
        ("an array", np.array(norm), False)])
    for name in ("weight", "bias"):
        value = case.array(norm, dt, name=name) if case.draw(st.booleans(), name) else None
        case.add(name, value, float_options(case, case.values(norm, dt), anchored=DTYPE,
                                            optional=True, bad_shapes=[norm + (1,), ()]),
                 keyword=True)
    eps = case.draw(st.sampled_from([1e-5, 0.0, 1.0]), "eps")
    case.add("eps", eps, [("-1e-5", -1e-5, True), ("nan", math.nan, True), ("inf", math.inf, True),
                          ("'1e-5'", "1e-5", True), ("None", None, True), ("True", True, True),
                          ("10**400", 10**400, True), ("np.float32(1e-3)", np.float32(1e-3), False),
                          ("1", 1, False)], keyword=True)
    case.mutate()

    def check(result, a):
        x, w, b = f64(a["x"]), f64(a["weight"]), f64(a["bias"])
        dt = dtype_of(a["x"])
        ns = a["normalized_shape"]
        ns = tuple(int(n) for n in (ns if np.iterable(ns) else (ns,)))
        eps = float(a["eps"])
        if not backward:
            expect(result, x.shape, dt)
            if case.finite and eps > 0:
                want = reference.layer_norm_forward(x, ns, w, b, eps)
                close(result, want, dt, 20.0 * (1 + np.abs(want)).max(initial=1))
            return
        dx, dw, db = result
        expect(dx, x.shape, dt, "dx")
        for g, p, what in ((dw, w, "dweight"), (db, b, "dbias")):
            if p is None:
                assert g is None, f"{what} must be None"
            else:
                expect(g, p.shape, dt, what)
        if case.finite and eps >= 1e-5 and x.size:
            dout = f64(a["dout"])
            want = reference.layer_norm_backward(dout, x, ns, w, b, eps)
            d = math.prod(ns)
            # rstd can be 1/√eps: a row of (nearly) equal entries amplifies rounding
            amp = 1.0 / math.sqrt(eps) * (1 + np.abs(dout).max()) * (1 + np.abs(
                w if w is not None else 1).max()) * 20.0 * (d + x.size)
            for g, ref, what in zip(result, want, ("dx", "dweight", "dbias")):
                if g is not None:
                    close(g, ref, dt, amp, what)

    case.run(fn, check)




def gen_gelu(case, fn, backward):
    dt = case.dtype()
    shape = case.draw(shapes(max_ndim=3, max_dim=6), "shape")
    case.group = ["x", "dout"]
    if backward:
        dout = case.array(shape, dt, name="dout")
        case.add("dout", dout, float_options(case, dout, anchored=DTYPE,
                                             bad_shapes=[shape + (1,), (2,) + shape]))
    x = case.add("x", case.array(shape, dt, name="x"))
    case.options["x"] = float_options(case, x, anchored=DTYPE if backward else False)
    approximate = case.draw(st.sampled_from(["none", "tanh"]), "approximate")
    case.add("approximate", approximate, choice_options(["none", "tanh"]),
             keyword=case.draw(st.booleans(), "approximate="))
    case.mutate()

    def check(result, a):
        x = f64(a["x"])
        dt = dtype_of(a["x"])
        expect(result, x.shape, dt)
        with np.errstate(all="ignore"):
            if not backward:
                want = reference.gelu_forward(x, a["approximate"])
                close(result, want, dt, np.abs(x))
                return
            dout = f64(a["dout"])
            want = reference.gelu_backward(dout, x, a["approximate"])
            close(result, want, dt, np.abs(dout) * (1 + np.abs(x)))

    case.run(fn, check)


def gen_rotary(case, fn, backward):
    dt = case.dtype()
    lead = case.draw(shapes(max_ndim=2, max_dim=4), "lead")
    length, h = case.draw(sizes(), "L"), case.draw(sizes(), "E/2")
    shape = lead + (length, 2 * h)
    name = "dout" if backward else "x"
    case.group = [name, "cos", "sin"]
    x = case.add(name, case.array(shape, dt, name=name))
    case.options[name] = float_options(case, x, anchored=DTYPE, bad_shapes=[
        (2 * h,), lead + (length, 2 * h + 1), lead + (length + 1, 2 * h)])
    theta = case.rng.uniform(-10.0, 10.0, (length, h))
    for table, values in (("cos", np.cos(theta)), ("sin", np.sin(theta))):
        arr = case.add(table, lay_out(np.ascontiguousarray(values, dt), case.draw(
            st.sampled_from(LAYOUTS), f"{table} layout"), case.rng))
        case.options[table] = float_options(case, arr, anchored=DTYPE, bad_shapes=[
            (length, h + 1), (1, length, h), (h,)])
    case.add("interleaved", case.draw(st.booleans(), "interleaved"), flag_options(),
             keyword=case.draw(st.booleans(), "interleaved="))
    case.mutate()

    def check(result, a):
        x, c, s = f64(a[name]), f64(a["cos"]), f64(a["sin"])
        expect(result, x.shape, dtype_of(a[name]))
        op = reference.rotary_embedding_backward if backward else reference.rotary_embedding_forward
        close(result, op(x, c, s, bool(a["interleaved"])), dtype_of(a[name]),
              np.abs(x).max(initial=0))

    case.run(fn, check)

