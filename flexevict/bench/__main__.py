from .throughput import main

main()
