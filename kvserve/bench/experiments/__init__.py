"""One module per ``kvserve bench`` experiment: two or more settings or systems in
alternating rounds on the same machine, each reported as the median of the rounds'
ratios (:mod:`kvserve.bench.instruments.paired`)."""
