"""`filter_jit` and what it needs: the call signature, donation, the traced-step checks, lowering."""
