"""Example user models for `python -m sweep model=custom model.target=examples.<module>:<factory>`."""
