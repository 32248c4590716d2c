"""Stage 5, verdict: the result type every check returns, and the gate that turns a toggle's
contract and the comparison into results."""
