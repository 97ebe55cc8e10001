from bench.faults import main

raise SystemExit(main())
