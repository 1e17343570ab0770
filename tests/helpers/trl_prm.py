"""TRL's PRMTrainer (TRL 0.29.1, the last release that has it; installed apart by `make install`,
beside the TRL of the other checks) on a two-label token classifier: run in a process of its own
with that TRL first on the path. Per case of settings, writes the loss of one batch of every row,
every parameter's gradient, and the evaluation's loss and accuracy over the same rows.

    python tests/helpers/trl_prm.py MODEL_DIR TOKENIZER_DIR ROWS_JSON CASES_JSON OUT_FILE
"""

import json
import sys
import warnings

import torch


def main(model_dir, tokenizer_dir, rows_file, cases_file, out_file):
    """Per case (PRMConfig's settings, output_dir among them): the figures, written to ``out_file``."""
    from transformers import AutoTokenizer

    warnings.filterwarnings("ignore")
    with open(rows_file) as f:
        rows = json.load(f)
    with open(cases_file) as f:
        cases = json.load(f)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.save({case: figures(model_dir, tokenizer, rows, settings) for case, settings in cases.items()}, out_file)


def figures(model_dir, tokenizer, rows, settings) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForTokenClassification
    from trl.experimental.prm import PRMConfig, PRMTrainer

    model = AutoModelForTokenClassification.from_pretrained(model_dir, dtype=torch.float32)
    data = Dataset.from_list(rows)
    args = PRMConfig(report_to="none", use_cpu=True, bf16=False, per_device_eval_batch_size=len(rows), **settings)
    trainer = PRMTrainer(model=model, args=args, train_dataset=data, eval_dataset=data, processing_class=tokenizer)
    trainer.model.train()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {n: p.grad for n, p in trainer.model.named_parameters()}
    evaluated = trainer.evaluate()
    return {"loss": float(loss), "grads": grads, "eval_loss": evaluated["eval_loss"],
            "eval_accuracy": evaluated["eval_accuracy"], "input_ids": list(map(list, trainer.train_dataset["input_ids"]))}


if __name__ == "__main__":
    main(*sys.argv[1:])
