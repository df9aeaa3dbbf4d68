"""Every matplotlib figure and model card moectl writes, beside no runtime code: the papers' routing
figures (``plots``), TE-MoE controllers' curves and cards (``option_plots``, ``option_curves``,
``controller_card``), RoE's tau figures (``roe_plots``), the residency lab's hit rates
(``residency_plots``), ``moectl report``'s bars (``eval_plots``), EMO's similarity heatmaps
(``similarity_plots``), serve-offload's load timeline (``offload_plots``) and a pretrained model's
card (``model_card``). The runtime imports a figure's module only when it draws (matplotlib loads
then)."""
