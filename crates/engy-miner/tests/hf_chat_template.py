"""Expected prompt ids from Hugging Face transformers (docs/PROTOCOL.md §3.1).

Usage: python3 hf_chat_template.py <checkpoint dir> <conversations.json>
Prints a JSON list: for each conversation, the ids of
tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True).
Needs only `transformers` (and its `tokenizers`), no torch.
"""
import json
import sys

from transformers import AutoTokenizer


def main() -> None:
    ckpt, convs_path = sys.argv[1], sys.argv[2]
    tok = AutoTokenizer.from_pretrained(ckpt)
    with open(convs_path, encoding="utf-8") as f:
        convs = json.load(f)
    out = []
    for messages in convs:
        ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if isinstance(ids, dict):  # BatchEncoding in some versions
            ids = ids["input_ids"]
        out.append([int(i) for i in ids])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
