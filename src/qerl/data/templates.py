"""Prompt construction: the paper's answer-format suffixes and the model's chat template."""

# QeRL (arXiv 2510.11696) appends these to each problem; the reward reads the answer style they ask for.
GSM8K_SUFFIX = 'Let\'s think step by step and output the final answer after "####".'
BOXED_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."
SUFFIXES = {"gsm8k": GSM8K_SUFFIX, "boxed": BOXED_SUFFIX, "none": ""}


def resolve_suffix(suffix: str | None) -> str:
    """A suffix name ("gsm8k", "boxed", "none") or a literal suffix string -> the suffix text."""
    if suffix is None:
        return ""
    return SUFFIXES.get(suffix, suffix)


def build_prompt(question: str, tokenizer=None, suffix: str | None = GSM8K_SUFFIX, system: str | None = None) -> str:
    """The text to feed the model for one problem.

    The user turn is `question` + a newline + `suffix` (a name from SUFFIXES or literal text).
    With a tokenizer that has a chat template, the turn (after an optional system message) goes through
    it with the generation prompt appended; otherwise (base models, the test tokenizer) the prompt is the
    plain user text (system text first) followed by a newline.
    """
    suffix = resolve_suffix(suffix)
    user = f"{question.strip()}\n{suffix}" if suffix else question.strip()
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"{system}\n\n{user}\n" if system else f"{user}\n"


def encode_prompt(text: str, tokenizer) -> list[int]:
    """Token ids of a built prompt. A chat template already wrote the special tokens (BOS included), so
    none are added again; plain prompts get the tokenizer's usual ones."""
    templated = bool(getattr(tokenizer, "chat_template", None))
    return tokenizer(text, add_special_tokens=not templated)["input_ids"]
