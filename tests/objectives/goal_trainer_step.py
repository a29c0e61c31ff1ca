"""Runs docs/objectives.md's ``transformers.Trainer`` example (the file argv[1]), then one
plain SGD step of its ``GoalTrainer`` on one batch of its dataset, and prints as JSON what
tests/objectives/test_goal_loss.py checks: the steps the example logged, and how far that
SGD step is from the one ``GoalLoss``'s own gradient gives through the model's
``get_image_features`` / ``get_text_features``.

A process of its own: the Trainer sets up accelerate's process-wide state.
"""

import copy
import json
import math
import runpy
import sys

import torch
import torch.nn.functional as F
from transformers import TrainingArguments

from mmgoal import GoalLoss

LEARNING_RATE = 0.01
GOAL = {"triplet": "cir", "pair": {"type": "sig_ms", "lam": "auto"}}


def features(output) -> torch.Tensor:
    """A tensor before transformers 5, a model output holding it as ``pooler_output`` since."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


example = runpy.run_path(sys.argv[1])
logged = [entry["loss"] for entry in example["trainer"].state.log_history if "loss" in entry]

model = copy.deepcopy(example["model"]).train()
batch_examples = example["dataset"][:8]
batch = example["collate"](batch_examples)
reference = copy.deepcopy(model)
image = F.normalize(features(reference.get_image_features(pixel_values=batch["pixel_values"])),
                    dim=-1)
text = F.normalize(features(reference.get_text_features(
    input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])), dim=-1)
GoalLoss(**GOAL)(image, text).backward()
expected = {name: (p - LEARNING_RATE * p.grad if p.grad is not None else p).detach()
            for name, p in reference.named_parameters()}
before = {name: p.detach().clone() for name, p in model.named_parameters()}

# the batch in any order: GOAL over pairs is the same for any order of them
args = TrainingArguments(output_dir=sys.argv[2], optim="sgd", learning_rate=LEARNING_RATE,
                         lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
                         max_steps=1, per_device_train_batch_size=len(batch_examples),
                         remove_unused_columns=False, save_strategy="no", report_to="none",
                         use_cpu=True, disable_tqdm=True)
example["GoalTrainer"](model=model, args=args, train_dataset=batch_examples,
                       data_collator=example["collate"], goal=GoalLoss(**GOAL)).train()
after = dict(model.named_parameters())
print(json.dumps({
    "logged_losses": [float(loss) for loss in logged],
    "max_difference": max(float((after[name] - expected[name]).abs().max())
                          for name in expected),
    "max_update": max(float((after[name] - before[name]).abs().max()) for name in before),
    "logit_scale_moved": not torch.equal(after["logit_scale"], before["logit_scale"]),
    "all_finite": all(math.isfinite(float(p.abs().max())) for p in after.values()),
}))
