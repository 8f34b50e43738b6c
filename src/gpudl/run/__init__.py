"""The entry points: a run from a recipe or a user's module, stage by stage."""
