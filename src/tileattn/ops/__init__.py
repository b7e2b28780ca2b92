"""One module per public capability: validate inputs, pick a backend, autograd + custom ops."""
