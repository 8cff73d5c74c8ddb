"""Model code, one file per architecture family."""
