"""The public ops: ``<op>_forward`` / ``<op>_backward`` pairs (and the plain PyTorch name as the
forward). Each checks its arguments, makes them C-contiguous, allocates the outputs, calls a
kernel and shapes the results back; none loops over elements."""
