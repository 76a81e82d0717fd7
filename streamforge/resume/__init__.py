"""Resume: the saved state's layout, and the exact, elastic and statistical ways of continuing from it."""
