"""Prompt construction: the paper's answer-format suffixes and the model's chat template."""

# QeRL (arXiv 2510.11696) appends these to each problem; the reward reads the answer style they ask for.
GSM8K_SUFFIX = 'Let\'s think step by step and output the final answer after "####".'
BOXED_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."
SUFFIXES = {"gsm8k": GSM8K_SUFFIX, "boxed": BOXED_SUFFIX, "none": ""}


LITERAL_PREFIX = "text:"


def resolve_suffix(suffix: str | None) -> str:
    """A suffix name ("gsm8k", "boxed", "none"), "text:<literal text>", or one of the named suffixes' own
    texts -> the suffix text. Anything else is a ValueError (with "did you mean" for a near-miss): a mistyped
    name must not become prompt text."""
    if suffix is None:
        return ""
    if suffix in SUFFIXES:
        return SUFFIXES[suffix]
    if suffix.startswith(LITERAL_PREFIX):
        return suffix[len(LITERAL_PREFIX):].strip()
    if suffix in SUFFIXES.values():
        return suffix
    import difflib

    close = difflib.get_close_matches(suffix.lower(), SUFFIXES, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ValueError(f"unknown suffix {suffix!r}: {hint}use one of {', '.join(SUFFIXES)}, or "
                     f"'{LITERAL_PREFIX}<your text>' for literal prompt text")


# The answer format each named suffix asks for (a `qerl.rewards.extract` style); other suffixes ask for none.
SUFFIX_STYLES = {GSM8K_SUFFIX: "gsm8k", BOXED_SUFFIX: "boxed"}


def requested_style(suffix: str | None) -> str | None:
    """The answer style a prompt suffix asks for: "gsm8k" (`####`), "boxed" (`\\boxed{}`), or None (none,
    no suffix, or a "text:" suffix other than a named suffix's own words)."""
    return SUFFIX_STYLES.get(resolve_suffix(suffix))


def build_prompt(question: str, tokenizer=None, suffix: str | None = GSM8K_SUFFIX, system: str | None = None) -> str:
    """The text to feed the model for one problem.

    The user turn is `question` + a newline + `suffix` (`resolve_suffix`: a name from SUFFIXES or
    "text:...").
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
