"""The model store: models on disk under short names, Hub downloads, the default model, name -> checkpoint.
May import engine.checkpoints; never engine.serving."""
