"""`report_fallback`: one info-level line per reason why generation or a forward takes its plain path."""

import logging


# the faster path not taken -> the line, logged by that path's module's logger (filters set on it keep working)
_LINES = {
    "shared_prefix": "shared_prefix: the {where} runs without prompt sharing because {reason}.",
    "lean_decoding": "generate_batched decodes with model.generate instead of the lean loop: {reason}.",
    "chunked_lm_head": "chunked_lm_head: the {where} come from the model's logits because {reason}.",
    "padding_free": "padding_free: the {where} runs on padded rows because {reason}.",
}
_MODULES = {
    "shared_prefix": "generation.sharing",
    "lean_decoding": "generation.lean",
    "chunked_lm_head": "core.lm_head",
    "padding_free": "core.packing",
}
_reported: set[tuple[str, str, str]] = set()


def report_fallback(where: str, reason: str, path: str = "shared_prefix") -> None:
    """Log, once per `(path, where, reason)` and process, that `where` (e.g. "generation", "log-prob forward") runs
    without `path` ("shared_prefix": prompt sharing; "lean_decoding": the lean decode loop; "chunked_lm_head": the
    head applied to hidden states in chunks; "padding_free": rows packed without padding) because of `reason`."""
    if (path, where, reason) not in _reported:
        _reported.add((path, where, reason))
        logging.getLogger(f"trl_unified.{_MODULES[path]}").info(_LINES[path].format(where=where, reason=reason))
