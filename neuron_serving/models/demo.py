"""A tiny random-weight Llama checkpoint, built fully offline.

No model hub is reachable on development machines, yet tests, benchmarks and `make
serve` need a real Hugging Face directory that vLLM loads through its Llama path. The
output is byte-identical for a given seed, so greedy token ids can be compared across
runs, tensor-parallel degrees and machines.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Shopping-assistant queries and answers: the tokenizer learns merges from these, so
# prompts in tests and benchmarks tokenize into a few, realistic subword pieces.
CORPUS = """\
Do you have running shoes in size 10?
Yes, we have several running shoes in size 10, including trail and road models.
What is the return policy for electronics?
Electronics can be returned within 30 days with the original receipt and packaging.
How long does standard shipping take?
Standard shipping usually takes 3 to 5 business days.
Is express delivery available to my zip code?
Express delivery is available in most areas; enter your zip code at checkout to confirm.
I am looking for a waterproof winter jacket for hiking.
Here are three waterproof winter jackets rated for hiking in cold weather.
Show me wireless headphones under 100 dollars.
These wireless headphones are under 100 dollars and have good battery life.
Is this coffee maker in stock?
The coffee maker is in stock and ships within one business day.
When will the blue dress in medium be back in stock?
The blue dress in medium is expected back in stock next week.
What sizes does this t-shirt come in?
This t-shirt comes in sizes small, medium, large and extra large.
Does the sofa come with free assembly?
Free assembly is included with delivery for all sofas over 500 dollars.
I want a gift for my dad who likes cooking.
A cast iron skillet, a chef knife or a spice set would make a great gift.
Recommend a laptop for college students.
For students we recommend a light laptop with long battery life and 16 GB of memory.
What is the difference between these two phones?
The newer phone has a better camera, a faster chip and a larger battery.
Can I use two coupons on one order?
Only one coupon can be applied per order, but sale prices still apply.
My order has not arrived yet.
I am sorry about the delay. Please share your order number and I will check the status.
How do I track my order?
You can track your order from the link in your confirmation email or in your account.
How do I cancel my order?
Open your orders page, select the order and choose cancel if it has not shipped.
Are these jeans true to size?
Most customers say these jeans run true to size, with a slightly relaxed fit.
What colors does the backpack come in?
The backpack comes in black, navy, olive green and gray.
Do you have gluten free snacks?
We have over 200 gluten free snacks, including crackers, chips and granola bars.
Which running shoes are best for flat feet?
Stability running shoes with firm arch support work well for flat feet.
Is this toy safe for a three year old?
This toy is recommended for ages three and up and has no small parts.
How much is shipping to Canada?
Shipping to Canada starts at 12 dollars for orders under 2 kilograms.
Can I pick up my order in store?
Yes, choose store pickup at checkout and we will email you when it is ready.
Are there any discounts for teachers?
Teachers get 15 percent off school supplies with a valid school ID.
I need a charger for my phone.
Which phone model do you have? I can show you compatible chargers.
Does this monitor support 4K resolution?
Yes, this 27 inch monitor supports 4K resolution at 60 Hz.
Please add the red sneakers to my cart.
The red sneakers in size 9 have been added to your cart.
What is in my cart?
Your cart has running shoes, a water bottle and two pairs of socks.
How do I return an item bought online?
Print the free return label from your account and drop the box at any carrier location.
When will I get my refund?
Refunds are issued within 5 to 7 business days after we receive the item.
Do you have this sweater in a larger size?
The sweater is available in large and extra large in gray and cream.
Show me the best rated vacuum cleaners.
Here are the top rated vacuum cleaners based on customer reviews.
Is there a sale on winter boots this week?
Winter boots are 30 percent off through Sunday.
Thank you for your help!
You are welcome. Is there anything else I can help you find today?
"""

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
UNK, BOS, EOS, PAD = SPECIAL_TOKENS[:4]
TARGET_VOCAB_SIZE = 2000
MODEL_MAX_LENGTH = 2048

# A turn is "<|role|>\n{content}</s>\n"; ending every turn with EOS is what lets a
# model trained on this format stop after its own reply.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Transformers' default std (0.02) puts the top-2 greedy logits within ~0.05 of each
# other often enough that float reordering (TP all-reduce, different kernels) can flip
# the argmax; 0.2 spreads logits by ~3 units, so greedy output is stable and comparable.
INITIALIZER_RANGE = 0.2


def _write_json(path: Path, obj: Any) -> None:
    # sort_keys + fixed indent: byte-identical files for identical inputs. The
    # transformers version stamp is dropped so the bytes depend only on the seed.
    obj = {k: v for k, v in obj.items() if k != "transformers_version"}
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        # Every byte is in the vocabulary, so any text (not just the corpus) encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    # Pad to a multiple of 64 so vocab-parallel shards split evenly, with reserved
    # tokens rather than bare embedding rows: every id the model emits then decodes.
    pad = -tokenizer.get_vocab_size() % 64
    tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(pad)])
    # Llama convention: the tokenizer, not the caller, prepends BOS to plain prompts.
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def _write_tokenizer(out: Path, tokenizer) -> None:
    tokenizer.save(str(out / "tokenizer.json"))
    special = {
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": PAD,
        "additional_special_tokens": SPECIAL_TOKENS[4:],
    }
    _write_json(out / "special_tokens_map.json", special)
    _write_json(
        out / "tokenizer_config.json",
        {
            **special,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": MODEL_MAX_LENGTH,
            "chat_template": CHAT_TEMPLATE,
        },
    )


def _llama_config(tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        # Divisible by every TP degree we test (1, 2).
        num_key_value_heads=2,
        head_dim=64,
        hidden_act="silu",
        max_position_embeddings=MODEL_MAX_LENGTH,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=INITIALIZER_RANGE,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=tokenizer.token_to_id(EOS),
        pad_token_id=tokenizer.token_to_id(PAD),
        dtype="float32",
    )


def _unprintable_ids(tokenizer) -> list[int]:
    """Ids whose text is empty or not printable: special and reserved tokens, lone
    UTF-8 bytes, control characters. EOS stays reachable so generations can end."""
    eos_id = tokenizer.token_to_id(EOS)
    ids = []
    for i in range(tokenizer.get_vocab_size()):
        text = tokenizer.decode([i], skip_special_tokens=True)
        printable = text and "\ufffd" not in text and text.replace("\n", "").isprintable()
        if i != eos_id and not printable:
            ids.append(i)
    return ids


def _write_weights(out: Path, config, seed: int, unprintable_ids: list[int]) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    # fork_rng: seeding must not leak into the caller's global RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # transformers wraps Module.to with functools.wraps, which typeshed types as an
        # unbound function: the dtype is taken for ``self``.
        model = LlamaForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]
    # A zero lm_head row gives logit 0, far below the top logits (std ~3), so greedy
    # and typical sampling never pick these ids: random-weight output then streams as
    # visible text instead of empty strings and U+FFFD that flake text assertions.
    with torch.no_grad():
        model.lm_head.weight[unprintable_ids] = 0.0
    state = {name: t.detach().contiguous() for name, t in sorted(model.state_dict().items())}
    # Fixed metadata (no timestamps, no library versions) keeps the file reproducible.
    path = out / "model.safetensors"
    save_file(state, str(path), metadata={"format": "pt"})
    # safetensors creates the file 0600; followers and tritonserver may run as
    # another user reading a shared directory, like the JSON files beside it.
    path.chmod(0o644)


def build_demo_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the demo checkpoint into ``out_dir`` (created if needed) and return it."""
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    _write_tokenizer(out, tokenizer)
    config = _llama_config(tokenizer)
    _write_json(out / "config.json", config.to_diff_dict())
    generation = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=False,
    )
    _write_json(out / "generation_config.json", generation.to_diff_dict())
    _write_weights(out, config, seed, _unprintable_ids(tokenizer))
    return out
