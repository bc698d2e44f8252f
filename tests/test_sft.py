"""task=sft: instruction rows (prompt and response, or chats) fine-tune a decoder on the answers' tokens alone,
optionally packed into full blocks whose chats attend to themselves alone."""

import json

import pytest
import torch

from pipeline import data, job, models
from pipeline.data import IGNORE_INDEX
from tests.conftest import compose_cfg


def write_rows(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def arithmetic(n: int, offset: int = 0) -> list[dict]:
    """`n` prompt/response rows of different lengths."""
    return [
        {
            "prompt": f"Add {a} and {a * 7 + 3}." + " Please." * (a % 5),
            "response": f"{a * 8 + 3}" + "!" * (a % 3),
        }
        for a in range(offset, offset + n)
    ]


def chat(row: dict) -> list[dict]:
    return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]


def sft_cfg(tmp_path, *extra, rows=None):
    rows = rows or arithmetic(300)
    test_rows = arithmetic(60, offset=1000)
    if "messages" in rows[0]:  # (both files of one kind: `datasets` reads them as one)
        test_rows = [{"messages": chat(r)} for r in test_rows]
    train = write_rows(tmp_path / "train.jsonl", rows)
    test = write_rows(tmp_path / "test.jsonl", test_rows)
    return compose_cfg(
        "task=sft",
        "model=llama-tiny",
        "data=csv",
        f"data.train_file={train}",
        f"data.eval_file={test}",
        "train.max_length=48",
        f"outputs_dir={tmp_path}",
        *extra,
    )


def test_the_prompts_and_the_padding_are_left_out_of_the_labels(tmp_path):
    import datasets

    cfg = sft_cfg(tmp_path)
    tokenizer = models.load_tokenizer(cfg.model)
    rows = arithmetic(8)
    chats = [
        [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["response"]}]
        for r in rows
    ]
    read = data.Splits(datasets.Dataset.from_dict({"messages": chats}), None, [])
    done = data.tokenize(read, tokenizer, 48, len(tokenizer), "sft")
    assert done.task == "causal_lm"
    batch = data.PaddingCollator(tokenizer, "longest", 48, "causal_lm")([done.train[i] for i in range(8)])
    for row, ids, labels, mask in zip(
        rows, batch["input_ids"], batch["labels"], batch["attention_mask"], strict=True
    ):
        # the default template, tokenized here on its own: the prompt's tokens, then the answer's and its end
        head = tokenizer(f"### Instruction:\n{row['prompt']}\n\n### Response:\n", add_special_tokens=False)
        answer = tokenizer(row["response"], add_special_tokens=False)["input_ids"] + [tokenizer.sep_token_id]
        p, n = len(head["input_ids"]), len(head["input_ids"]) + len(answer)
        assert ids[:n].tolist() == head["input_ids"] + answer and mask[:n].all() and not mask[n:].any()
        assert (labels[:p] == IGNORE_INDEX).all() and labels[p:n].tolist() == answer
        assert (labels[n:] == IGNORE_INDEX).all()  # the padding


def test_chats_read_as_prompt_and_response_rows_are_and_a_bad_column_is_one_line(tmp_path):
    chats = [
        {
            "messages": [
                {"role": "user", "content": r["prompt"]},
                {"role": "assistant", "content": r["response"]},
            ]
        }
        for r in arithmetic(300)
    ]
    as_rows = data.prepare(sft_cfg(tmp_path / "rows"))[1].train
    as_chats = data.prepare(sft_cfg(tmp_path / "chats", rows=chats))[1].train
    assert as_rows["input_ids"] == as_chats["input_ids"] and as_rows["labels"] == as_chats["labels"]
    with pytest.raises(ValueError, match=r"task=sft reads data.prompt_column .* \['question'\] not found"):
        data.prepare(sft_cfg(tmp_path / "bad", "data.prompt_column=question"))


def test_the_loss_is_over_the_answers_tokens_alone(tmp_path):
    cfg = sft_cfg(tmp_path)
    tokenizer, splits, collate = data.prepare(cfg)
    torch.manual_seed(0)
    model = models.build(cfg, splits.label_names, tokenizer.pad_token_id).model
    batch = collate([splits.train[i] for i in range(8)])
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(50)  # logits far from uniform: each token's loss its own
        out = model(**batch)
    logits, following = out.logits[:, :-1], batch["labels"][:, 1:]
    kept = following != IGNORE_INDEX
    by_hand = torch.nn.functional.cross_entropy(logits[kept].float(), following[kept])
    everything = torch.nn.functional.cross_entropy(
        logits[batch["attention_mask"][:, 1:] == 1].float(),
        batch["input_ids"][:, 1:][batch["attention_mask"][:, 1:] == 1],
    )
    assert out.loss.item() == pytest.approx(by_hand.item(), rel=1e-5)
    assert abs(by_hand.item() - everything.item()) > 0.1  # (the prompts' tokens would count otherwise)


def test_packing_makes_fewer_fuller_rows_whose_chats_attend_to_themselves_alone(tmp_path):
    cfg = sft_cfg(tmp_path, "train.max_length=96")
    tokenizer, plain, _ = data.prepare(cfg)
    packed_cfg = sft_cfg(tmp_path, "train.max_length=96", "train.packing=true")
    _, packed, collate = data.prepare(packed_cfg)
    assert len(packed.train) < len(plain.train) / 2
    lengths = [len(ids) for ids in packed.train["input_ids"]]
    assert max(lengths) <= 96 and sum(lengths) == sum(len(ids) for ids in plain.train["input_ids"])
    assert sum(lengths) / len(lengths) > 2 * sum(len(i) for i in plain.train["input_ids"]) / len(plain.train)
    assert packed.train["labels"][0].count(IGNORE_INDEX) > 0
    # each chat in a packed row gets the logits it gets alone: no attention across chats
    torch.manual_seed(0)
    model = models.build(packed_cfg, [], tokenizer.pad_token_id).model.eval()
    row = packed.train[0]
    batch = collate([row])
    assert "attention_mask" not in batch and batch["position_ids"][0].tolist() == row["position_ids"]
    with torch.no_grad():
        together = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["position_ids"])]
        assert len(starts) > 2
        for a, b in zip(starts, starts[1:], strict=False):
            alone = model(input_ids=batch["input_ids"][:, a:b]).logits[0]
            torch.testing.assert_close(together[a:b], alone, rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_lora_job_on_instruction_rows_trains_as_planned(tmp_path):
    """llama-tiny with LoRA on 300 JSONL rows of prompt and response: its peak within 1% of its plan, its
    evaluation over the answers' tokens."""
    cfg = sft_cfg(tmp_path, "peft=lora", "train.max_steps=4", "batch_size=8")
    (tmp_path / "job").mkdir()
    result = job.run(cfg, tmp_path / "job")
    m = result["metrics"]
    assert abs(m["predicted_peak_error_pct"]) <= 1, m
    assert m["eval_perplexity"] > 1 and 0 <= m["eval_next_token_accuracy"] <= 1
    assert len(result["series"]["train_loss"]) == 4
