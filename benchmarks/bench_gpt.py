"""gpt: nanoGPT's model end to end, npattn.models.GPT against the same model in PyTorch eager.

Cases (issue 14's):

- **train step**: forward, backward and one AdamW step on a fixed batch, nanoGPT's CPU "baby"
  config (n_layer 4, n_head 4, n_embd 128, block 64, batch 12, dropout 0) and the 6-layer one
  (n_layer 6, n_head 6, n_embd 384, block 256, batch 8). vocab_size 65 (tiny Shakespeare's).
  AdamW as nanoGPT's ``configure_optimizers``: lr 1e-3, betas (0.9, 0.99), weight decay 0.1 on
  the 2-D weights only. Each call is one whole step; the weights move from call to call, the
  work does not.
- **generate**: greedy KV-cached generation of one sequence, 48 new tokens after a 16-token
  prompt (baby config) and 192 after 64 (6-layer config, block 256): a prefill, then one
  token at a time. PyTorch runs the same cached computation (``benchmarks/torch_gpt.py``:
  ``decode``/``greedy``), under ``torch.no_grad()``.

Both models start from the same weights (npattn's init, through the state_dict; generation
cases use larger N(0, 0.3²) weights so that the greedy choices are far from ties). Agreement
before timing: the first training step's logits and loss (float32 tolerance), and the greedy
tokens exactly. There is no NumPy column.

Each row reports time per call (a training step; a whole generation) and tokens/s (B·T
trained tokens per step; new tokens per generation). GFLOP/s are nominal, nanoGPT's
``estimate_mfu`` count: 6·N + 12·L·C·T FLOPs per trained token (N parameters without the
position embedding), 2·N + 4·L·C·T per generated token, T the attended context (the mean for
generation). Full runs measure the peak memory of one training step, each implementation in
a fresh process. ``python -m benchmarks.gpt_profile`` shows where npattn's step spends its time.
"""
import numpy as np

from npattn import optim
from npattn.models import GPT, GPTConfig

from .cases import Bench, case
from .torch_gpt import greedy, torch_gpt

VOCAB = 65
LR, BETAS, WEIGHT_DECAY = 1e-3, (0.9, 0.99), 0.1
# (n_layer, n_head, n_embd, block_size, batch)
BABY = (4, 4, 128, 64, 12)
SIX = (6, 6, 384, 256, 8)
TRAIN_QUICK = (1, 2, 32, 16, 2)
# (n_layer, n_head, n_embd, block_size, prompt, new)
GEN_BABY = (4, 4, 128, 64, 16, 48)
GEN_SIX = (6, 6, 384, 256, 64, 192)
GEN_QUICK = (1, 2, 32, 16, 4, 6)
NOTE = ("gpt GFLOP/s are nominal (nanoGPT's estimate_mfu: 6·N + 12·L·C·T per trained token, "
        "2·N + 4·L·C·T per generated one); tokens/s: B·T trained per step, new tokens per "
        "generation")


def config(n_layer, n_head, n_embd, block_size):
    return GPTConfig(block_size=block_size, vocab_size=VOCAB, n_layer=n_layer, n_head=n_head,
                     n_embd=n_embd, dropout=0.0)


def n_params(cfg):
    """Parameters without the position embedding (nanoGPT's get_num_params)."""
    c, v = cfg.n_embd, cfg.vocab_size
    per_block = 4 * c + 3 * c * c + 3 * c + c * c + c + 4 * c * c + 4 * c + 4 * c * c + c
    return v * c + cfg.n_layer * per_block + 2 * c


def decay_groups(params_2d, params_1d):
    return [{"params": params_2d, "weight_decay": WEIGHT_DECAY},
            {"params": params_1d, "weight_decay": 0.0}]


def torch_train_step(torch, model, x, y):
    """(step, optimizer): one PyTorch training step of ``model`` on the batch (x, y) as a
    function -- zero_grad, forward, backward, AdamW (decay_groups, LR, BETAS) -- returning the
    logits and the loss, detached; and its AdamW."""
    params = list(model.parameters())
    opt = torch.optim.AdamW(decay_groups([p for p in params if p.dim() >= 2],
                                         [p for p in params if p.dim() < 2]), lr=LR, betas=BETAS)

    def step():
        opt.zero_grad(set_to_none=True)
        logits, loss = model(x, y)
        loss.backward()
        opt.step()
        return logits.detach(), loss.detach()
    return step, opt


def torch_peer(torch, cfg, state):
    """The PyTorch model with npattn's weights (float32)."""
    peer = torch_gpt(torch, cfg)
    peer.load_state_dict({k: torch.from_numpy(np.array(v, np.float32)) for k, v in state.items()})
    return peer


def _label(kind, cfg, extra):
    return (f"gpt {kind} L{cfg.n_layer} H{cfg.n_head} C{cfg.n_embd} T{cfg.block_size} {extra}")


@case("gpt", sizes=[BABY, SIX], quick=[TRAIN_QUICK])
def gpt_train_step(torch, n_layer, n_head, n_embd, block_size, batch):
    cfg = config(n_layer, n_head, n_embd, block_size)
    model = GPT(cfg, rng=0, seed=0)
    rng = np.random.default_rng(1)
    x = rng.integers(0, VOCAB, (batch, block_size))
    y = rng.integers(0, VOCAB, (batch, block_size))
    params = list(model.parameters())
    opt = optim.AdamW(decay_groups([p for p in params if p.data.ndim >= 2],
                                   [p for p in params if p.data.ndim < 2]),
                      lr=LR, betas=BETAS)

    def ours():
        model.zero_grad()
        logits, loss = model(x, y)
        model.backward()
        opt.step()
        return logits, loss

    impls = {"npattn": ours}
    if torch is not None:
        peer = torch_peer(torch, cfg, model.state_dict())
        impls["PyTorch"] = torch_train_step(torch, peer, torch.from_numpy(x),
                                            torch.from_numpy(y))[0]
    tokens = batch * block_size
    flops = tokens * (6 * n_params(cfg) + 12 * n_layer * n_embd * block_size)
    return Bench(_label("train step", cfg, f"B{batch}"), flops=flops, impls=impls,
                 notes=[NOTE], tokens=tokens,
                 rss_warmup=TRAIN_QUICK, operand_bytes=4 * sum(p.data.size for p in params))


def far_from_ties(model, rng):
    """N(0, 0.3²) weights (LayerNorm weights 1 + N(0, 0.1²)): logits spread enough that float32
    rounding never flips a greedy choice between the two implementations."""
    state = {}
    for name, array in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        if ".ln_" in name and name.endswith("weight"):
            state[name] = (1 + 0.1 * rng.standard_normal(array.shape)).astype(np.float32)
        else:
            state[name] = (0.3 * rng.standard_normal(array.shape)).astype(np.float32)
    state["lm_head.weight"] = state["transformer.wte.weight"]
    model.load_state_dict(state)
    return state


@case("gpt", sizes=[GEN_BABY, GEN_SIX], quick=[GEN_QUICK])
def gpt_generate(torch, n_layer, n_head, n_embd, block_size, prompt, new):
    cfg = config(n_layer, n_head, n_embd, block_size)
    model = GPT(cfg, rng=0)
    rng = np.random.default_rng(2)
    state = far_from_ties(model, rng)
    idx = rng.integers(0, VOCAB, (1, prompt))
    impls = {"npattn": lambda: model.generate(idx, new, top_k=1)}
    if torch is not None:
        peer = torch_peer(torch, cfg, state).eval()
        tidx = torch.from_numpy(idx)
        impls["PyTorch"] = lambda: greedy(torch, peer, tidx, new)
    mean_context = prompt + (new - 1) / 2
    flops = new * (2 * n_params(cfg) + 4 * n_layer * n_embd * mean_context)
    return Bench(_label("generate", cfg, f"{prompt}→+{new}"), flops=flops, impls=impls,
                 notes=[NOTE], tokens=new)
