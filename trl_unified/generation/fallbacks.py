"""`report_fallback`: one info-level line per reason why generation or a forward takes its plain path."""

import logging


# the faster path not taken -> (its module's logger, the line); filters set on those loggers keep working
_PATHS = {
    "shared_prefix": (
        logging.getLogger("trl_unified.generation.sharing"),
        "shared_prefix: the {where} runs without prompt sharing because {reason}.",
    ),
    "lean_decoding": (
        logging.getLogger("trl_unified.generation.lean"),
        "generate_batched decodes with model.generate instead of the lean loop: {reason}.",
    ),
    "chunked_lm_head": (
        logging.getLogger("trl_unified.core.lm_head"),
        "chunked_lm_head: the {where} come from the model's logits because {reason}.",
    ),
    "padding_free": (
        logging.getLogger("trl_unified.core.packing"),
        "padding_free: the {where} runs on padded rows because {reason}.",
    ),
}
_reported: set[tuple[str, str, str]] = set()


def report_fallback(where: str, reason: str, path: str = "shared_prefix") -> None:
    """Log, once per `(path, where, reason)` and process, that `where` (e.g. "generation", "log-prob forward") runs
    without `path` ("shared_prefix": prompt sharing; "lean_decoding": the lean decode loop; "chunked_lm_head": the
    head applied to hidden states in chunks; "padding_free": rows packed without padding) because of `reason`."""
    if (path, where, reason) not in _reported:
        _reported.add((path, where, reason))
        logger, line = _PATHS[path]
        logger.info(line.format(where=where, reason=reason))
