from gptpipe.cli import main

raise SystemExit(main())
