"""One module per algorithm: a config and a thin trainer subclass of PolicyTrainerBase."""
