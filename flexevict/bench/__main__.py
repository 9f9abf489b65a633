from flexevict.bench.throughput import main

main()
