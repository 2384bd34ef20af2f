"""Plumbing shared by every trl_unified trainer. Importing a module here never imports a trainer."""
