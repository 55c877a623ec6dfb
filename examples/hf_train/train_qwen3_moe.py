"""Train a small Qwen3-MoE model from Hugging Face transformers once per experts implementation --
by default transformers' own `experts_implementation="grouped_mm"` and `"moe_engine"` -- from the
same initial weights on the same data, and compare the loss curves and the step time.

    python3 examples/hf_train/train_qwen3_moe.py --steps 300 --png loss.png
    python3 examples/hf_train/train_qwen3_moe.py --implementations grouped_mm moe_engine moe_engine_fp8

The first implementation named is the baseline each other run is compared with; `moe_engine_fp8`
runs the experts' GEMMs in FP8 block scaling (hidden and expert FFN sizes multiples of 16).

The model is Qwen3-MoE's architecture scaled to fit one GPU quickly (the sizes are arguments). The
data is synthetic text that can be learned: token sequences drawn from a fixed random Markov chain
whose rows are sparse, so the loss falls from log(vocab) towards the chain's entropy. All runs
use bf16 parameters and AdamW; only the experts implementation differs. Needs a Hopper GPU,
transformers 5.x and the moe_engine package (pip install . in the repository root)."""
import argparse
import json
import math
import statistics
import time

import torch


def markov_chain(vocab, branching, seed):
    """A transition table: each token is followed by one of `branching` tokens, with fixed probs."""
    g = torch.Generator().manual_seed(seed)
    nxt = torch.randint(0, vocab, (vocab, branching), generator=g)
    probs = torch.softmax(torch.randn(vocab, branching, generator=g) * 2.0, -1)
    return nxt, probs


def batches(nxt, probs, batch, seq, steps, seed):
    """`steps` batches [batch, seq] of token ids from the chain (on the CPU, then moved)."""
    g = torch.Generator().manual_seed(seed)
    vocab = nxt.shape[0]
    out = []
    for _ in range(steps):
        ids = torch.empty(batch, seq, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for t in range(1, seq):
            choice = torch.multinomial(probs[ids[:, t - 1]], 1, generator=g).squeeze(1)
            ids[:, t] = nxt[ids[:, t - 1], choice]
        out.append(ids)
    return out


def chain_entropy(probs):
    """Entropy per token of the chain's transitions averaged over tokens (a floor for the loss)."""
    return float(-(probs * probs.log()).sum(-1).mean())


def build_model(args):
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m
    config = m.Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                              moe_intermediate_size=args.ffn, num_hidden_layers=args.layers,
                              num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 4),
                              head_dim=args.hidden // args.heads, num_experts=args.experts,
                              num_experts_per_tok=args.topk, norm_topk_prob=True, max_position_embeddings=args.seq,
                              tie_word_embeddings=False)
    torch.manual_seed(args.seed)
    model = m.Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # a fixed, explicit initialisation (the same for both runs)
        g = torch.Generator().manual_seed(args.seed)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model.to("cuda", torch.bfloat16)


def train(args, implementation, data):
    import moe_engine.integrations.transformers  # noqa: F401  (registers "moe_engine" and "moe_engine_fp8")
    model = build_model(args)
    model.set_experts_implementation(implementation)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    losses, times = [], []
    for step, ids in enumerate(data):
        ids = ids.cuda(non_blocking=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        end.synchronize()
        losses.append(loss.item())
        if step >= args.warmup:
            times.append(start.elapsed_time(end))
    del model, opt
    torch.cuda.empty_cache()
    return losses, statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20, help="steps left out of the step-time median")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=256, help="expert FFN size (moe_intermediate_size)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--implementations", nargs="+", default=["grouped_mm", "moe_engine"],
                    help="experts implementations to train with, the first the baseline (also: eager, moe_engine_fp8)")
    ap.add_argument("--png", help="write the loss curves to this PNG file")
    ap.add_argument("--json", help="write the losses and step times to this JSON file")
    args = ap.parse_args()

    nxt, probs = markov_chain(args.vocab, 4, args.seed)
    data = batches(nxt, probs, args.batch, args.seq, args.steps, args.seed + 1)
    floor = chain_entropy(probs)
    impls = list(dict.fromkeys(args.implementations))
    if len(impls) < 2:
        ap.error("argument --implementations: name at least two (the first is the baseline)")
    results = {}
    for impl in impls:
        losses, ms = train(args, impl, data)
        results[impl] = {"losses": losses, "step_ms": ms}
        print(f"{impl:>14}: median step {ms:.2f} ms, loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)

    base = impls[0]
    a = results[base]["losses"]
    tail = max(1, len(a) // 5)
    print(f"loss floor (chain entropy) {floor:.3f}, log(vocab) {math.log(args.vocab):.3f}")
    for impl in impls[1:]:
        b = results[impl]["losses"]
        mean_gap = sum(abs(x - y) for x, y in zip(a[-tail:], b[-tail:])) / tail
        rel_gap = mean_gap / (sum(a[-tail:]) / tail)
        speed = results[base]["step_ms"] / results[impl]["step_ms"]
        results[impl].update({"mean_gap": mean_gap, "rel_gap": rel_gap, "speedup": speed})
        print(f"{impl} against {base}, last {tail} steps: mean |loss difference| {mean_gap:.4f} "
              f"({100 * rel_gap:.2f}% of the loss); step time {base} / {impl} = {speed:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "floor": floor, "baseline": base, "results": results}, f)
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for i, impl in enumerate(impls):
            style = ("-", "--", ":", "-.")[i % 4]
            r = results[impl]
            ax.plot(r["losses"], style, label=f"{impl} ({r['step_ms']:.1f} ms/step)")
        ax.axhline(floor, color="gray", lw=0.8, ls=":", label="chain entropy")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_title(f"Qwen3-MoE ({args.layers} layers, H={args.hidden}, {args.experts} experts, top-{args.topk}, "
                     f"F={args.ffn}), {torch.cuda.get_device_name()}", fontsize=9)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
