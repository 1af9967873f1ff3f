"""The main job: one DDTree step end to end on the ops, printed.

Random draft logits -> top-K -> ``ddtree_build`` -> a toy target verifies every node (a fixed
random next-token table that agrees with the drafter's top choice 80 % of the time) ->
``tree_accept`` -> ``kv_commit`` moves the accepted nodes' cache rows.  Runs on CUDA when the
kernels and a GPU are present, else on the CPU references.
"""
from __future__ import annotations

import argparse

import torch

import torch_kdtree
from torch_kdtree.ops import ddtree_build, kv_commit, tree_accept


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    info = torch_kdtree.build_info()
    device = "cuda" if info["cuda_kernels"] and info["cuda_available"] else "cpu"
    print(f"torch_kdtree {torch_kdtree.__version__}: {info}; running on {device}")
    g = torch.Generator().manual_seed(args.seed)
    L, B, V = args.depth, args.budget, args.vocab
    K = min(B, V)

    logits = torch.randn(1, L, V, generator=g) * 3
    lp, ids = torch.log_softmax(logits, -1).topk(K, -1)
    # the toy target follows the drafter's argmax with probability 0.8, else a random token
    follow = torch.rand(V, generator=g) < 0.8
    target_next = torch.where(follow, torch.empty(V, dtype=torch.long).fill_(-1), torch.randint(0, V, (V,), generator=g))
    root = torch.tensor([int(torch.randint(0, V, (), generator=g))])

    lp, ids, root = lp.contiguous().to(device), ids.contiguous().to(device), root.to(device)
    tree = ddtree_build(lp, ids, root, B)
    # target token at node i: the drafter's top token one level deeper (if followed), else random
    depth = tree.depths.clamp(min=0)
    top_next = torch.cat([ids[0, :, 0], ids.new_full((1,), -1)])[depth.clamp(max=L)]
    table = target_next.to(device)
    post = torch.where(table[tree.tokens.clamp(min=0)] < 0, top_next, table[tree.tokens.clamp(min=0)])
    post = torch.where(post < 0, torch.zeros_like(post), post)
    acc = tree_accept(tree.tokens, tree.parents, post)

    # a paged latent cache (2 layers, page size 4, D = 576) holding 5 committed tokens + the tree
    layers, page, D = 2, 4, 576
    committed = 5
    pages = (committed + B + 1 + page - 1) // page
    kv = torch.arange(layers * pages * page, dtype=torch.float32, device=device).repeat_interleave(D)
    kv = kv.reshape(layers, pages, page, D).to(torch.bfloat16)
    block_table = torch.arange(pages, dtype=torch.int32, device=device)[None]
    lens = torch.tensor([committed], dtype=torch.int32, device=device)
    kv_commit(kv, block_table, lens, acc.indices, acc.lengths)

    n = int(acc.lengths[0])
    path = acc.indices[0, :n].tolist()
    print(f"tree: {B} nodes over depth <= {L}, K = {K}; max depth reached {int(tree.depths.max())}")
    print("  node parent depth token")
    for i in range(min(B + 1, 12)):
        print(f"  {i:4d} {int(tree.parents[0, i]):6d} {int(tree.depths[0, i]):5d} {int(tree.tokens[0, i]):5d}")
    print(f"accepted path (node indices): {path}")
    print(f"accepted tokens: {tree.tokens[0, path].tolist()} + next root {int(acc.next_tokens[0])}")
    print(f"tokens committed this step: {n} (the root plus {n - 1} drafted)")
    rows = kv[0, :, :, 0].flatten()[committed:committed + n].float().tolist()
    print(f"cache rows after commit (layer 0, positions {committed}..{committed + n - 1}): "
          f"came from positions {[int(r) for r in rows]}")


if __name__ == "__main__":
    main()
