"""Generated gRPC code for tierd.v1 (make proto); never edited by hand."""
