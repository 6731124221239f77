"""Fuzz case generators for the modules (``npattn.nn``) (the harness: ``fuzz_harness``; the table that
maps public names to generators, and the tests: ``test_fuzz``)."""
from fuzz_harness import *  # noqa: F401,F403 -- Case, the option generators, helpers
from fuzz_functional import mask_shape


# ---------------------------------------------------------------------------- nn modules

def backward_first(case, module, dout):
    """``backward`` before any ``forward`` is a RuntimeError that says so."""
    COUNTS[case.target] += 1
    with pytest.raises(RuntimeError, match="before forward"):
        module.backward(dout)


def construct(case, cls, check=None):
    """Mutate and call the constructor; the module, or None when it rightly raised."""
    case.mutate()
    return case.run(cls, check or (lambda module, a: None))


def check_grads(module, finite):
    for name, param in module.named_parameters():
        expect(param.grad, param.data.shape, param.data.dtype, f"{name}.grad")
        if finite:
            assert np.all(np.isfinite(param.grad)), f"{name}.grad is not finite"


def module_dtype(case):
    dt = case.dtype()
    case.add("dtype", dt, dtype_options(), keyword=True)
    return dt


def built_dtype(a):
    return np.dtype(a["dtype"])


def gen_linear_module(case, cls):
    fin, fout = case.draw(dims(5), "in"), case.draw(dims(5), "out")
    case.add("in_features", fin, size_options(fin))
    case.add("out_features", fout, size_options(fout))
    case.add("bias", case.draw(st.booleans(), "bias"), flag_options())
    module_dtype(case)
    case.add("rng", case.draw(st.integers(0, 9), "rng"), rng_options(), keyword=True)
    module = construct(case, cls)
    if module is None:
        return
    dt = module.weight.dtype
    fin, fout = module.in_features, module.out_features
    lead = case.draw(shapes(max_ndim=2, max_dim=4), "lead")
    backward_first(case, module, np.zeros(lead + (fout,), dt))
    case.stage()
    x = case.add("x", case.array(lead + (fin,), dt, name="x"))
    case.options["x"] = float_options(case, x, anchored=True, bad_shapes=[(), lead + (fin + 1,)])
    case.mutate()

    def check_forward(y, a):
        x = f64(a["x"])
        expect(y, x.shape[:-1] + (fout,), dt)
        if case.finite:
            b = None if module.bias is None else f64(module.bias.data)
            close(y, reference.linear_forward(x, f64(module.weight.data), b), dt,
                  20.0 * (1 + np.abs(x).sum(axis=-1, keepdims=True)))

    if case.run(module, check_forward) is None:
        return
    finite = case.finite
    case.stage()
    dout = case.add("dout", case.values(lead + (fout,), dt))
    case.options["dout"] = float_options(case, dout, anchored=True,
                                         bad_shapes=[lead + (fout + 1,), (2,) + lead + (fout,)])
    case.mutate()
    case.run(module.backward, lambda dx, a: (expect(dx, lead + (fin,), dt),
                                             check_grads(module, finite)))


def gen_dropout_module(case, cls):
    case.add("p", case.draw(st.sampled_from([0.0, 0.5, 1.0]), "p"), probability_options())
    case.add("seed", case.draw(st.integers(0, 9), "seed"), rng_options("seed"), keyword=True)
    module = construct(case, cls)
    if module is None:
        return
    dt = case.dtype()
    shape = case.draw(shapes(max_ndim=3, max_dim=4), "shape")
    backward_first(case, module, np.zeros(shape, dt))
    if case.draw(st.booleans(), "eval"):
        module.eval()
    case.stage()
    x = case.add("x", case.array(shape, dt, name="x"))
    case.options["x"] = float_options(case, x, anchored=False)
    case.mutate()

    def check_forward(y, a):
        x = np.asarray(a["x"])
        expect(y, x.shape, x.dtype)
        if not module.training or module.p == 0:
            assert np.array_equal(y, x, equal_nan=True), "dropout off must return x"
        elif module.p == 1:
            assert not np.any(y), "p = 1 must zero everything"

    y = case.run(module, check_forward)
    if y is None:
        return
    case.stage()
    dout = case.add("dout", case.values(y.shape, y.dtype))
    case.options["dout"] = float_options(case, dout, anchored=False,
                                         bad_shapes=[y.shape + (1,), (2,) + y.shape])
    case.mutate()
    case.run(module.backward, lambda dx, a: expect(dx, y.shape, dtype_of(a["dout"])))


def sequence_input(case, dt, width, name="x"):
    """x (B, L, width) or (L, width), and the mask options for an (L, L) attention."""
    batch = case.draw(st.sampled_from([(), (1,), (2,)]), "batch")
    length = case.draw(dims(4), "L")
    x = case.add(name, case.array(batch + (length, width), dt, ("normal",) * 3 + ("nan", "huge"),
                                  name=name))
    case.options[name] = float_options(case, x, anchored=True, bad_shapes=[
        (width,), batch + (length, width + 1)])
    return batch, length


def gen_self_attention(case, cls):
    d_model, d_k = case.draw(st.integers(1, 5), "d_model"), case.draw(st.integers(1, 4), "d_k")
    case.add("d_model", d_model, size_options(d_model, 1))
    case.add("d_k", d_k, size_options(d_k, 1))
    d_v = case.draw(st.one_of(st.none(), st.integers(1, 4)), "d_v")
    case.add("d_v", d_v, optional_size_options(d_v))
    case.add("bias", case.draw(st.booleans(), "bias"), flag_options())
    case.add("dropout", case.draw(st.sampled_from([0.0, 0.0, 0.5]), "dropout"),
             probability_options(), keyword=True)
    module_dtype(case)
    case.add("rng", 0, rng_options(), keyword=True)
    case.add("seed", 1, rng_options("seed"), keyword=True)
    module = construct(case, cls)
    if module is None:
        return
    dt = module.W_Q.weight.dtype
    backward_first(case, module, np.zeros((1, module.d_v), dt))
    if case.draw(st.booleans(), "eval"):
        module.eval()
    case.stage()
    batch, length = sequence_input(case, dt, module.d_model)
    full = batch + (length, length)
    mask = None
    kind = case.draw(st.sampled_from(["none", "bool", "float"]), "mask")
    if kind == "bool":
        mask = case.rng.random(mask_shape(case, full)) < 0.7
    elif kind == "float":
        mask = case.array(mask_shape(case, full), dt, ("normal", "masked"), "mask")
    case.add("mask", mask, [("as int64", np.zeros(full, np.int64), True),
                            ("the other float dtype", np.zeros(full, other_float(dt)), True),
                            ("a string", "abc", True),
                            (f"shape {full[:-1] + (length + 2,)}",
                             np.ones(full[:-1] + (length + 2,), bool), True),
                            ("None", None, False)])
    case.add("is_causal", case.draw(st.booleans(), "is_causal"), flag_options())
    case.mutate()

    def check_forward(result, a):
        out, weights = result
        x = np.asarray(a["x"])
        expect(out, x.shape[:-1] + (module.d_v,), dt, "output")
        expect(weights, x.shape[:-1] + (x.shape[-2],), dt, "weights")
        if case.finite:
            assert np.all(np.isfinite(out)) and np.all(np.isfinite(weights)), "not finite"

    result = case.run(module, check_forward)
    if result is None:
        return
    finite = case.finite
    case.stage()
    out_shape = result[0].shape
    dout = case.add("dout", case.values(out_shape, dt))
    case.options["dout"] = float_options(case, dout, anchored=True,
                                         bad_shapes=[out_shape[:-1] + (out_shape[-1] + 1,)])
    case.mutate()
    x_shape = out_shape[:-1] + (module.d_model,)
    case.run(module.backward, lambda dx, a: (expect(dx, x_shape, dt, "dx"),
                                             check_grads(module, finite)))


def gen_multihead_attention(case, cls):
    heads = case.draw(st.integers(1, 3), "num_heads")
    embed = heads * case.draw(st.integers(1, 3), "head_dim")
    case.add("embed_dim", embed, size_options(embed, 1) + [
        ("embed_dim + 1", embed + 1, "embed_dim" if heads > 1 else False)])
    case.add("num_heads", heads, size_options(heads, 1) + [("embed_dim + 1", embed + 1, True)])
    case.add("dropout", case.draw(st.sampled_from([0.0, 0.0, 0.5]), "dropout"),
             probability_options())
    for name in ("bias", "add_bias_kv", "add_zero_attn"):
        case.add(name, case.draw(st.booleans(), name), flag_options())
    for name in ("kdim", "vdim"):
        width = case.draw(st.one_of(st.none(), st.integers(1, 4)), name)
        case.add(name, width, optional_size_options(width))
    case.add("batch_first", case.draw(st.booleans(), "batch_first"), flag_options())
    module_dtype(case)
    case.add("rng", 0, rng_options(), keyword=True)
    case.add("seed", 1, rng_options("seed"), keyword=True)
    module = construct(case, cls)
    if module is None:
        return
    dt = module.out_proj.weight.dtype
    backward_first(case, module, np.zeros((1, module.embed_dim), dt))
    if case.draw(st.booleans(), "eval"):
        module.eval()
    case.stage()
    batched = case.draw(st.booleans(), "batched")
    n = case.draw(st.integers(1, 2), "N")
    length, n_keys = case.draw(dims(3), "L"), case.draw(dims(3), "S")
    h = module.num_heads

    def layout(seq, width):
        if not batched:
            return (seq, width)
        return (n, seq, width) if module.batch_first else (seq, n, width)

    for name, seq, width in (("query", length, module.embed_dim), ("key", n_keys, module.kdim),
                             ("value", n_keys, module.vdim)):
        shape = layout(seq, width)
        x = case.add(name, case.array(shape, dt, ("normal",) * 3 + ("nan", "huge"), name=name))
        bad = [(width,), shape[:-1] + (width + 1,)]
        if name == "value":
            bad.append(layout(seq + 1, width))
        if batched and name == "key":
            bad.append((n + 1, seq, width) if module.batch_first else (seq, n + 1, width))
        case.options[name] = float_options(case, x, anchored=True, bad_shapes=bad)
    kpm_shape = (n, n_keys) if batched else (n_keys,)
    kpm = None
    if case.draw(st.booleans(), "key_padding_mask"):
        kpm = (case.rng.random(kpm_shape) < 0.3 if case.draw(st.booleans(), "bool kpm") else
               case.array(kpm_shape, dt, ("normal", "masked"), "key_padding_mask"))
    case.add("key_padding_mask", kpm, [
        ("as int64", np.zeros(kpm_shape, np.int64), True),
        ("the other float dtype", np.zeros(kpm_shape, other_float(dt)), True),
        (f"shape {kpm_shape + (1,)}", np.zeros(kpm_shape + (1,), bool), True),
        ("a ragged list", RAGGED, True), ("None", None, False)], keyword=True)
    case.add("need_weights", case.draw(st.booleans(), "need_weights"), flag_options(),
             keyword=True)
    mask_shapes = [(length, n_keys), ((n * h) if batched else h, length, n_keys)]
    mask = None
    if case.draw(st.booleans(), "attn_mask"):
        shape = case.draw(st.sampled_from(mask_shapes), "attn_mask shape")
        mask = (case.rng.random(shape) < 0.3 if case.draw(st.booleans(), "bool mask") else
                case.array(shape, dt, ("normal", "masked"), "attn_mask"))
    case.add("attn_mask", mask, [
        ("as int64", np.zeros((length, n_keys), np.int64), True),
        ("the other float dtype", np.zeros((length, n_keys), other_float(dt)), True),
        (f"shape {(length + 1, n_keys)}", np.zeros((length + 1, n_keys), bool), True),
        ("one mask plane too many", np.zeros(((n * h if batched else h) + 1, length, n_keys),
                                              bool), True),
        ("an object", Malformed(), True), ("None", None, False)], keyword=True)
    case.add("average_attn_weights", case.draw(st.booleans(), "average"), flag_options(),
             keyword=True)
    case.add("is_causal", case.draw(st.booleans(), "is_causal"), flag_options(), keyword=True)
    case.mutate()
    extra = (module.bias_k is not None) + module.add_zero_attn

    def check_forward(result, a):
        out, weights = result
        q = np.asarray(a["query"])
        s = np.asarray(a["key"]).shape[-2 if (batched and module.batch_first) or
                                       not batched else 0] + extra
        expect(out, q.shape, dt, "attn_output")
        if not a["need_weights"]:
            assert weights is None, "attn_weights must be None without need_weights"
        else:
            lead = (n,) if batched else ()
            heads = () if a["average_attn_weights"] else (h,)
            expect(weights, lead + heads + (length, s), dt, "attn_weights")
        if case.finite:
            assert np.all(np.isfinite(out)), "attn_output is not finite"

    result = case.run(module, check_forward)
    if result is None:
        return
    finite = case.finite
    shapes_in = [np.asarray(case.args[n]).shape for n in ("query", "key", "value")]
    case.stage()
    out_shape = result[0].shape
    dout = case.add("dout", case.values(out_shape, dt))
    case.options["dout"] = float_options(case, dout, anchored=True,
                                         bad_shapes=[out_shape[:-1] + (out_shape[-1] + 1,)])
    case.mutate()

    def check_backward(grads, a):
        assert len(grads) == 3, f"{len(grads)} gradients"
        for g, shape, what in zip(grads, shapes_in, ("dquery", "dkey", "dvalue")):
            expect(g, shape, dt, what)
        check_grads(module, finite)

    case.run(module.backward, check_backward)


def gen_embedding_module(case, cls):
    n_rows, width = case.draw(dims(5), "num_embeddings"), case.draw(dims(4), "embedding_dim")
    case.add("num_embeddings", n_rows, size_options(n_rows))
    case.add("embedding_dim", width, size_options(width))
    pad = case.draw(st.one_of(st.none(), st.integers(-n_rows, n_rows - 1)) if n_rows else
                    st.none(), "padding_idx")
    case.add("padding_idx", pad, [("num_embeddings", n_rows, True), ("1.0", 1.0, True),
                                  ("'0'", "0", True), ("None", None, False)])
    module_dtype(case)
    case.add("rng", 0, rng_options(), keyword=True)
    module = construct(case, cls)
    if module is None:
        return
    n_rows, width, dt = module.num_embeddings, module.embedding_dim, module.weight.dtype
    shape = case.draw(shapes(max_ndim=2, max_dim=4), "indices shape")
    if n_rows == 0:
        shape = shape[:-1] + (0,) if shape else (0,)
    backward_first(case, module, np.zeros(shape + (width,), dt))
    case.stage()
    indices = case.rng.integers(0, max(n_rows, 1), size=shape)
    case.add("indices", indices, index_options(case, indices, stop=n_rows))
    case.mutate()
    out = case.run(module, lambda y, a: (
        expect(y, np.asarray(a["indices"]).shape + (width,), dt),
        close(y, f64(module.weight.data)[np.asarray(a["indices"])], dt, 0.0)))
    if out is None:
        return
    case.stage()
    dout = case.add("dout", case.values(out.shape, dt))
    case.options["dout"] = float_options(case, dout, anchored=True,
                                         bad_shapes=[out.shape[:-1] + (width + 1,)])
    case.mutate()

    def check_backward(result, a):
        assert result is None, "Embedding.backward returns None (indices have no gradient)"
        check_grads(module, True)
        if module.padding_idx is not None:
            assert not module.weight.grad[module.padding_idx].any(), "padding row got a grad"

    case.run(module.backward, check_backward)


def gen_positional_encoding(case, cls):
    d_model = case.draw(st.integers(1, 6), "d_model")
    max_len = case.draw(st.integers(0, 6), "max_len")
    case.add("d_model", d_model, size_options(d_model, 1))
    case.add("max_len", max_len, size_options(max_len))
    case.add("dropout", case.draw(st.sampled_from([0.0, 0.1]), "dropout"), probability_options())
    module_dtype(case)
    case.add("seed", 0, rng_options("seed"), keyword=True)
    module = construct(case, cls)
    if module is None:
        return
    dt = module.pe.dtype
    backward_first(case, module, np.zeros((1, module.d_model), dt))
    if case.draw(st.booleans(), "eval"):
        module.eval()
    case.stage()
    batch = case.draw(st.sampled_from([(), (2,)]), "batch")
    length = case.draw(st.integers(0, module.max_len), "L")
    x = case.add("x", case.array(batch + (length, module.d_model), dt, name="x"))
    case.options["x"] = float_options(case, x, anchored=True, bad_shapes=[
        (module.d_model,), batch + (length, module.d_model + 1),
        batch + (module.max_len + 1, module.d_model)])
    case.mutate()

    def check_forward(y, a):
        x = f64(a["x"])
        expect(y, x.shape, dt)
        if not module.training or module.dropout.p == 0:
            close(y, x + f64(module.pe)[0, :x.shape[-2]], dt, 1.0)

    y = case.run(module, check_forward)
    if y is None:
        return
    case.stage()
    dout = case.add("dout", case.values(y.shape, dt))
    case.options["dout"] = float_options(case, dout, anchored=False,
                                         bad_shapes=[y.shape + (1,)])
    case.mutate()
    case.run(module.backward, lambda dx, a: expect(dx, y.shape, dtype_of(a["dout"])))


def gen_layer_norm_module(case, cls):
    norm = case.draw(shapes(min_ndim=1, max_ndim=2, max_dim=4), "normalized_shape")
    case.add("normalized_shape", norm if len(norm) > 1 else norm[0], [
        ("()", (), True), ("(-1,)", (-1,), True), ("'3'", "3", True), ("None", None, True),
        ("2.0", 2.0, True), ("True", True, True), ("a list", list(norm), False)])
    case.add("eps", case.draw(st.sampled_from([1e-5, 0.1]), "eps"), [
        ("-1.0", -1.0, True), ("nan", math.nan, True), ("'x'", "x", True),
        ("10**400", 10**400, True), ("None", None, True), ("0", 0, False)])
    case.add("elementwise_affine", case.draw(st.booleans(), "affine"), flag_options())
    case.add("bias", case.draw(st.booleans(), "bias"), flag_options())
    module_dtype(case)
    module = construct(case, cls)
    if module is None:
        return
    norm = module.normalized_shape
    dt = case.dtype() if module.weight is None else module.weight.dtype
    lead = case.draw(shapes(max_ndim=2, max_dim=3), "lead")
    backward_first(case, module, np.zeros(lead + norm, dt))
    case.stage()
    x = case.add("x", case.array(lead + norm, dt, name="x"))
    case.options["x"] = float_options(case, x, anchored=module.weight is not None, bad_shapes=[
        lead + norm[:-1] + (norm[-1] + 1,), ()])
    case.mutate()

    def check_forward(y, a):
        x = f64(a["x"])
        expect(y, x.shape, dtype_of(a["x"]))
        if case.finite and module.eps > 0:
            w = None if module.weight is None else f64(module.weight.data)
            b = None if module.bias is None else f64(module.bias.data)
            want = reference.layer_norm_forward(x, norm, w, b, module.eps)
            close(y, want, dtype_of(a["x"]), 20.0 * (1 + np.abs(want).max(initial=0)))

    y = case.run(module, check_forward)
    if y is None:
        return
    finite = case.finite and module.eps > 0      # eps = 0, a constant sample: 0/0 = NaN
    case.stage()
    dout = case.add("dout", case.values(y.shape, y.dtype))
    case.options["dout"] = float_options(case, dout, anchored=True,
                                         bad_shapes=[y.shape + (1,)])
    case.mutate()
    case.run(module.backward, lambda dx, a: (expect(dx, y.shape, y.dtype),
                                             check_grads(module, finite)))


def gen_sequential(case, cls):
    dt = case.dtype()
    width = case.draw(st.integers(1, 4), "width")
    layers = [nn.Linear(width, width, dtype=dt, rng=0), nn.LayerNorm(width, dtype=dt),
              nn.Dropout(0.5, seed=0)]
    if case.draw(st.booleans(), "eval"):
        for layer in layers:
            layer.eval()
    for i, layer in enumerate(layers):
        case.add(f"argument {i}", layer, [("None", None, True), ("a function", np.tanh, True),
                                          ("a string", "Linear", True),
                                          ("the class", nn.Linear, True)])
    module = construct(case, cls, lambda m, a: (len(m) == len(layers)) or
                       pytest.fail("Sequential lost a module"))
    if module is None:
        return
    backward_first(case, module, np.zeros((1, width), dt))
    case.stage()
    lead = case.draw(shapes(max_ndim=2, max_dim=3), "lead")
    x = case.add("x", case.array(lead + (width,), dt, name="x"))
    case.options["x"] = float_options(case, x, anchored=True, bad_shapes=[lead + (width + 1,)])
    case.mutate()
    y = case.run(module, lambda y, a: expect(y, lead + (width,), dt))
    if y is None:
        return
    finite = case.finite
    case.stage()
    dout = case.add("dout", case.values(y.shape, dt))
    case.options["dout"] = float_options(case, dout, anchored=True, bad_shapes=[y.shape + (1,)])
    case.mutate()
    case.run(module.backward, lambda dx, a: (expect(dx, y.shape, dt),
                                             check_grads(module, finite)))


def gen_module_base(case, cls):
    """The base class's own methods, on a small model: state_dict round trips with wrong
    dicts, ``to``, ``train``, ``zero_grad``."""
    dt = case.dtype()
    model = nn.Sequential(nn.Linear(3, 2, dtype=dt, rng=0), nn.LayerNorm(2, dtype=dt))
    assert isinstance(model, cls)
    state = model.state_dict()
    assert list(state) == ["0.weight", "0.bias", "1.weight", "1.bias"], list(state)
    good = {k: case.values(v.shape, v.dtype) for k, v in state.items()}
    missing = {k: v for k, v in good.items() if k != "1.bias"}
    extra = dict(good, extra=np.zeros(1))
    case.add("state_dict", good, [
        ("None", None, True), ("a list", [1, 2], True), ("a string", "abc", True),
        ("a wrong shape", dict(good, **{"0.weight": np.zeros((2, 4), dt)}),
         "state_dict['0.weight']"),
        ("int values", {k: v.astype(np.int64) for k, v in good.items()},
         "state_dict['0.weight']"),
        ("string values", {k: "abc" for k in good}, "state_dict['0.weight']"),
        ("ragged values", {k: RAGGED for k in good}, "state_dict['0.weight']"),
        ("a missing key", missing, "state_dict"), ("an extra key", extra, "state_dict"),
        ("float64 values", {k: v.astype(np.float64) for k, v in good.items()}, False),
        ("nested lists", {k: v.tolist() for k, v in good.items()}, False)])
    case.add("strict", case.draw(st.booleans(), "strict"),
             [("'yes'", "yes", True), ("None", None, True), ("1", 1, True),
              ("np.bool_(False)", np.bool_(False), False)])
    case.mutate()
    if case.args["state_dict"] is missing or case.args["state_dict"] is extra:
        if case.args["strict"] is False or case.args["strict"] is np.False_:
            case.bad.discard("state_dict")           # strict=False takes a partial dict

    def check_load(result, a):
        got = model.state_dict()
        for k, v in got.items():
            assert v.dtype == dt, f"{k} changed dtype to {v.dtype}"
            if isinstance(a["state_dict"], dict) and k in a["state_dict"]:
                close(v, f64(a["state_dict"][k]), dt, 1.0, k)

    case.run(model.load_state_dict, check_load)
    case.stage()
    case.add("dtype", dt, dtype_options() + [("None", None, False)])
    case.mutate()
    case.run(model.to, lambda m, a: [expect(p.data, p.data.shape, np.dtype(a["dtype"]))
                                     for p in m.parameters()])
    COUNTS[case.target] += 1
    model.train(case.draw(st.booleans(), "mode"))
    model.zero_grad()
    assert all(not p.grad.any() for p in model.parameters()), "zero_grad"


def gen_parameter(case, cls):
    dt = case.dtype()
    shape = case.draw(shapes(max_ndim=3, max_dim=4), "shape")
    data = case.add("data", case.array(shape, dt, name="data"))
    case.options["data"] = float_options(case, data, anchored=False)
    case.mutate()

    def check(param, a):
        want = np.asarray(a["data"])
        expect(param.data, want.shape, want.dtype, "data")
        expect(param.grad, want.shape, want.dtype, "grad")
        assert not param.grad.any(), "grad starts at zero"
        assert not np.shares_memory(param.data, want), "Parameter must own a copy"

    param = case.run(cls, check)
    if param is None:
        return
    case.stage()
    grad = case.add("grad", case.values(param.shape, param.dtype))
    case.options["grad"] = float_options(case, grad, anchored=False, bad_shapes=[
        param.shape + (2,), (3,) + param.shape])
    case.mutate()
    before = param.grad.copy()
    case.run(param.accumulate, lambda r, a: close(param.grad, before + f64(a["grad"]),
                                                  param.dtype, 1.0, "grad"))




def gen_gelu_module(case, cls):
    case.add("approximate", case.draw(st.sampled_from(["none", "tanh"]), "approximate"),
             choice_options(["none", "tanh"]))
    module = construct(case, cls)
    if module is None:
        return
    dt = case.dtype()
    shape = case.draw(shapes(max_ndim=3, max_dim=4), "shape")
    backward_first(case, module, np.zeros(shape, dt))
    case.stage()
    x = case.add("x", case.array(shape, dt, name="x"))
    case.options["x"] = float_options(case, x, anchored=False)
    case.mutate()

    def check_forward(y, a):
        x = f64(a["x"])
        expect(y, x.shape, dtype_of(a["x"]))
        close(y, reference.gelu_forward(x, module.approximate), dtype_of(a["x"]), np.abs(x))

    y = case.run(module, check_forward)
    if y is None:
        return
    x = module._saved
    case.stage()
    case.group = ["dout"]
    dout = case.add("dout", case.values(y.shape, y.dtype))
    case.options["dout"] = float_options(case, dout, anchored=True,
                                         bad_shapes=[y.shape + (1,), (2,) + y.shape])
    case.mutate()

    def check_backward(dx, a):
        expect(dx, y.shape, y.dtype)
        d = f64(a["dout"])
        close(dx, reference.gelu_backward(d, f64(x), module.approximate), y.dtype,
              np.abs(d) * (1 + np.abs(f64(x))))

    case.run(module.backward, check_backward)


def gen_rotary_module(case, cls):
    dim, max_len = 2 * case.draw(st.integers(1, 4), "dim/2"), case.draw(st.integers(0, 6),
                                                                          "max_len")
    case.add("dim", dim, size_options(dim, 2) + [("odd", dim + 1, True)])
    case.add("max_len", max_len, size_options(max_len))
    case.add("base", case.draw(st.sampled_from([10000.0, 10.0]), "base"), [
        ("0.0", 0.0, True), ("-1.0", -1.0, True), ("nan", math.nan, True), ("inf", math.inf, True),
        ("'1e4'", "1e4", True), ("None", None, True), ("an int", 500, False)])
    case.add("interleaved", case.draw(st.booleans(), "interleaved"), flag_options())
    module_dtype(case)
    module = construct(case, cls)
    if module is None:
        return
    dt = module.cos.dtype
    backward_first(case, module, np.zeros((1, module.dim), dt))
    case.stage()
    lead = case.draw(shapes(max_ndim=2, max_dim=3), "lead")
    offset = case.draw(st.integers(0, module.max_len), "offset")
    length = case.draw(st.integers(0, module.max_len - offset), "L")
    x = case.add("x", case.array(lead + (length, module.dim), dt, name="x"))
    case.options["x"] = float_options(case, x, anchored=True, bad_shapes=[
        (module.dim,), lead + (length, module.dim + 2),
        lead + (module.max_len - offset + 1, module.dim)])
    case.add("offset", offset, [("-1", -1, True), ("1.0", 1.0, True), ("None", None, True),
                                ("'0'", "0", True), ("True", True, True),
                                ("past max_len", module.max_len - length + 1, True),
                                ("np.int64", np.int64(offset), False)],
             keyword=case.draw(st.booleans(), "offset="))
    case.mutate()

    def check_forward(y, a):
        x = f64(a["x"])
        expect(y, x.shape, dt)
        rows = slice(int(a["offset"]), int(a["offset"]) + x.shape[-2])
        close(y, reference.rotary_embedding_forward(x, f64(module.cos[rows]),
                                                    f64(module.sin[rows]), module.interleaved),
              dt, np.abs(x).max(initial=0))

    y = case.run(module, check_forward)
    if y is None:
        return
    case.stage()
    dout = case.add("dout", case.values(y.shape, dt))
    case.options["dout"] = float_options(case, dout, anchored=True, bad_shapes=[
        y.shape[:-1] + (y.shape[-1] + 2,), y.shape[:-2] + (y.shape[-2] + 1, y.shape[-1]),
        (module.dim,)])
    case.mutate()
    case.run(module.backward, lambda dx, a: expect(dx, y.shape, dt))


def gen_module_list(case, cls):
    """The constructor with right and wrong ``modules``; then the list operations, PyTorch's
    names in state_dict, and the container's missing forward and backward."""
    dt = case.dtype()
    layers = [nn.Linear(2, 2, dtype=dt, rng=i) for i in range(case.draw(st.integers(0, 3),
                                                                         "length"))]
    case.add("modules", layers, [
        ("None", None, False), ("a tuple", tuple(layers), False),
        ("a generator", (m for m in layers), False), ("a Sequential", nn.Sequential(*layers),
                                                      False),
        ("a single Module", nn.GELU(), True), ("an int", 3, True), ("a string", "ab", True),
        ("a list with an int", layers + [3], True), ("a list with None", [None], True),
        ("a list with a class", [nn.Linear], True), ("an array", np.ones(2), True)])
    module = construct(case, cls, lambda m, a: None)
    if module is None:
        return
    n = len(module)
    assert n in (0, len(layers)), f"ModuleList holds {n} modules"
    names = [f"{i}.{p}" for i in range(n) for p in ("weight", "bias")]
    assert list(module.state_dict()) == names, list(module.state_dict())
    COUNTS[case.target] += 1
    for i in range(-n, n):
        assert module[i] is list(module)[i]
    for bad in (n, -n - 1):
        with pytest.raises(IndexError, match="out of range"):
            module[bad]
    with pytest.raises(NotImplementedError, match="no forward"):
        module(np.zeros((1, 2), dt))
    with pytest.raises(NotImplementedError, match="no backward"):
        module.backward(np.zeros((1, 2), dt))
    case.stage()
    case.add("module", nn.GELU(), [("None", None, True), ("an int", 3, True),
                                   ("a function", np.tanh, True), ("the class", nn.GELU, True),
                                   ("a Linear", nn.Linear(2, 2, dtype=dt), False)])
    case.mutate(most=1)

    def check_append(result, a):
        assert result is module and len(module) == n + 1 and module[-1] is a["module"]
        assert list(module._modules) == [str(i) for i in range(n + 1)]

    case.run(module.append, check_append)
