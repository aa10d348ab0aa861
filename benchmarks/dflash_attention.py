"""A one-off study (not a timing): where a DFlash drafter's block row 1 looks, on prompts it trained on and on
MT-bench. For each prompt the target (the default, through transformers) writes 64 greedy tokens; at every
response position a a block runs over the target's features before a (`DFlashDrafter.blocks`, as training runs it),
and per drafter layer row 1's attention (mean over heads) is split into: the last context position (c_{a-1}),
row 0 (the token x_a), the earlier context, and the block's mask rows. Row 1's top-1 agreement with the target's
next token is printed beside it.

    python -m benchmarks.dflash_attention runs/dflash_base/drafter
"""

import argparse
import gzip
import json

import torch

from specdistill.models import dflash as dflash_module
from specdistill.models.drafters import load_drafter
from specdistill.models.target import load_target


def read_prompts(path: str, key: str, skip: int, count: int) -> list[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        records = [json.loads(line) for line in f][skip:skip + count]
    return [r[key][0] if isinstance(r[key], list) else r[key] for r in records]


def recording_attention(log: list):
    """DFlashLayer.attend, also appending its weights [B, R, S] (mean over heads) to log."""
    original = dflash_module.DFlashLayer.attend

    def attend(self, q, keys, values, visible):
        groups = self.self_attn.num_heads // self.self_attn.num_kv_heads
        scores = q @ keys.repeat_interleave(groups, dim=-3).transpose(-1, -2) / q.shape[-1] ** 0.5
        log.append(torch.softmax(scores.masked_fill(~visible.unsqueeze(-3), float("-inf")), -1).mean(-3))
        return original(self, q, keys, values, visible)
    return attend


@torch.no_grad()
def study(target, drafter, texts: list[str], log: list) -> dict:
    size, layers = drafter.block_size, len(drafter.layers)
    parts = {name: [[] for _ in range(layers)] for name in ("last", "row0", "earlier")}
    hits = []
    for text in texts:
        ids = target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                   return_tensors="pt")
        ids = (ids if isinstance(ids, torch.Tensor) else ids["input_ids"])[:, :200]
        out = target.model.generate(ids, max_new_tokens=64, do_sample=False, pad_token_id=0)  # [1, T]
        states = target.model(out, output_hidden_states=True).hidden_states
        features = torch.cat([states[i] for i in drafter.target_layers], -1).float()  # [1, T, K x D]
        wanted = target.model.lm_head(states[-1]).argmax(-1)[0]  # [T]: the target's next token at each position
        t = out.shape[1]
        anchors = torch.arange(ids.shape[1] + 1, t - 2)[None]  # [1, A]
        log.clear()
        hidden = drafter.blocks(features, target.model.get_input_embeddings()(out.gather(1, anchors)).float(), anchors)
        drafted = drafter.vocab_map[drafter.logits(hidden[:, :, 1]).argmax(-1)][0]  # [A]
        hits.append((drafted == wanted[anchors[0]]).float().mean().item())
        for layer, weights in enumerate(log):
            for j, a in enumerate(anchors[0].tolist()):
                row = weights[0, j * size + 1]  # row 1 of block j: [T + A x size]
                parts["last"][layer].append(row[a - 1].item())
                parts["row0"][layer].append(row[t + j * size].item())
                parts["earlier"][layer].append(row[:a - 1].sum().item())

    def mean(values):
        return sum(values) / len(values)
    return {"row1_top1": mean(hits),
            "layers": [{name: mean(parts[name][i]) for name in parts} for i in range(layers)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafter", help="a dflash drafter directory for the default target")
    args = parser.parse_args()
    target = load_target()
    drafter = load_drafter(args.drafter, target).model.float().eval()
    log = []
    dflash_module.DFlashLayer.attend = recording_attention(log)
    sets = {"trained on (Arena-Hard v0.1, 10-17)": read_prompts("../shared/data/arena_hard/question_v0.1.jsonl",
                                                                  "prompt", 10, 8),
            "held out (MT-bench, 8 first turns)": read_prompts("../shared/data/mt_bench/question.jsonl", "turns", 0, 8)}
    for name, texts in sets.items():
        result = study(target, drafter, texts, log)
        print(f"{name}: row 1 top-1 {result['row1_top1']:.3f}")
        for i, part in enumerate(result["layers"]):
            masks = 1 - part["last"] - part["row0"] - part["earlier"]
            print(f"  layer {i}: c_(a-1) {part['last']:.3f}, row 0 {part['row0']:.3f}, earlier context "
                  f"{part['earlier']:.3f}, mask rows {masks:.3f}")


if __name__ == "__main__":
    main()
