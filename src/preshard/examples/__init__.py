"""Small, seeded example models and inputs, shared by the README, `preshard demo` and the tests."""
