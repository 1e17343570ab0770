"""TRL's PRMTrainer (TRL 0.29.1, the last release that has it; installed apart by `make install`,
beside the TRL of the other checks) on a two-label token classifier: run in a process of its own
with that TRL first on the path. Writes the loss of one batch of every training row, every
parameter's gradient, and the evaluation's loss and accuracy over the validation rows.

    python tests/helpers/trl_prm.py MODEL_DIR TOKENIZER_DIR ROWS_JSON SETTINGS_JSON OUT_FILE
"""

import json
import sys
import warnings

import torch


def main(model_dir, tokenizer_dir, rows_file, settings_file, out_file):
    from datasets import Dataset
    from transformers import AutoModelForTokenClassification, AutoTokenizer
    from trl.experimental.prm import PRMConfig, PRMTrainer

    warnings.filterwarnings("ignore")
    with open(rows_file) as f:
        rows = json.load(f)
    with open(settings_file) as f:
        settings = json.load(f)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForTokenClassification.from_pretrained(model_dir, dtype=torch.float32)
    data = Dataset.from_list(rows)
    args = PRMConfig(output_dir=settings.pop("output_dir"), report_to="none", use_cpu=True, bf16=False,
                     per_device_eval_batch_size=len(rows), **settings)
    trainer = PRMTrainer(model=model, args=args, train_dataset=data, eval_dataset=data, processing_class=tokenizer)
    trainer.model.train()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {n: p.grad for n, p in trainer.model.named_parameters()}
    evaluated = trainer.evaluate()
    torch.save({"loss": float(loss), "grads": grads, "eval_loss": evaluated["eval_loss"],
                "eval_accuracy": evaluated["eval_accuracy"], "input_ids": list(map(list, trainer.train_dataset["input_ids"]))},
               out_file)


if __name__ == "__main__":
    main(*sys.argv[1:])
