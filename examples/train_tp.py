"""Train a small Llama, tensor-parallel over all ranks, compiled with kareus.

    KAREUS_OPTIONS='{"time_budget": 1.05}' torchrun --nproc-per-node 2 examples/train_tp.py

kareus's options come from $KAREUS_OPTIONS (or $KAREUS_OPTIONS_FILE), none from code. Rank 0
prints the losses and the plan's predicted step beside the baseline's (every graph unrewritten
at the default clock), per GPU; ``--check``: the first loss against an uncompiled copy's.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import kareus
from kareus.models.llama import Llama, LlamaConfig, parallelize_llama


def build(cfg: LlamaConfig, mesh) -> Llama:
    torch.manual_seed(0)  # the same weights on every rank, and for the --check copy
    return parallelize_llama(Llama(cfg).to(mesh.device_type), mesh)


def loss_of(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--microbatch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--check", action="store_true", help="compare the first loss to eager")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:  # the ranks share this machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    dist.init_process_group("nccl" if cuda else "gloo")
    mesh = init_device_mesh("cuda" if cuda else "cpu", (dist.get_world_size(),))
    say = print if dist.get_rank() == 0 else (lambda *_: None)
    cfg = LlamaConfig(dim=args.dim, n_layers=args.layers, ffn_dim=2 * args.dim,
                      max_seq_len=args.seq_len)

    model = build(cfg, mesh)
    compiled = torch.compile(model, backend="kareus")  # options: $KAREUS_OPTIONS
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)  # the same batches on every rank
    successor = torch.randperm(cfg.vocab_size, generator=data)  # a learnable next token
    for step in range(args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (args.microbatch_size, 1), generator=data)
        for _ in range(args.seq_len):
            tokens = torch.cat([tokens, successor[tokens[:, -1:]]], dim=1)
        loss = loss_of(compiled, tokens.to(mesh.device_type))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 0 and args.check:
            eager = loss_of(build(cfg, mesh), tokens.to(mesh.device_type)).item()
            same = "exact" if loss.item() == eager else f"differs by {loss.item() - eager:.3g}"
            say(f"check: first loss {loss.item():.6f}, eager {eager:.6f}: {same}")
        say(f"step {step}: loss {loss.item():.4f}")

    plan = kareus.current_plan()
    if plan is None:
        say("no plan: nothing was profiled (profile=\"off\", or a plan file given)")
    else:
        new, base, budget = plan.predicted, plan.baseline, plan.budget
        amount = next((f" {a:g}" for a in (budget.fraction, budget.value) if a is not None), "")
        say(f"plan on {plan.device}, {budget.kind} budget{amount}, per GPU and step: "
            f"{new.time_s * 1e3:.4g} ms, {new.energy_j:.4g} J; baseline "
            f"{base.time_s * 1e3:.4g} ms, {base.energy_j:.4g} J "
            f"({new.energy_j / base.energy_j - 1:+.1%} energy, "
            f"{new.time_s / base.time_s - 1:+.1%} time)")
    dist.barrier()  # every rank done before the store's host leaves
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
