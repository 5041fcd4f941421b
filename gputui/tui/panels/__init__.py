"""The main screen's panels, one module each; base.py says what they have in common."""
