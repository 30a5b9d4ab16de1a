"""Test-only packages that plug into lightning_par the way a user's code would."""
