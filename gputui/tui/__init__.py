"""The Textual app: never imports torch (nor the engine)."""
