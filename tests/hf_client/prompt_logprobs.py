"""Run in the real-client environment (torch + transformers, no Paddle).

    python prompt_logprobs.py SNAPSHOT_DIR '[1, 20, 30, ...]'
    python prompt_logprobs.py '["DIR_A", "DIR_B"]' '[1, 20, 30, ...]'     (several snapshots: a list of lists)

Loads the snapshot with ``transformers.AutoModelForCausalLM.from_pretrained`` (float32) and prints one JSON
line: ``log p(ids[i] | ids[:i])`` for i >= 1, what a serving engine's prompt logprobs must equal.
"""
import json
import sys

import torch
import transformers


def logprobs(snapshot, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]


def main():
    snapshots, ids = sys.argv[1], json.loads(sys.argv[2])
    if snapshots.startswith("["):
        print(json.dumps([logprobs(s, ids) for s in json.loads(snapshots)]))
    else:
        print(json.dumps(logprobs(snapshots, ids)))


if __name__ == "__main__":
    main()
